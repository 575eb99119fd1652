"""Finding the code blocks of README.md and docs/*.md, and running one on several ranks (see test_docs_examples).

Kept out of the test module so spawned ranks can import :func:`run_script_as_torchrun_rank` by name.
"""

from __future__ import annotations

import os
import re
import runpy
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL
)
_MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<args>.*?)\s*-->")
SERVICES = frozenset({"s3"})


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its label, the ranks it runs on (python only) and its text."""

    doc: str
    line: int
    lang: str
    ranks: tuple[int, ...]
    code: str
    needs: tuple[str, ...] = ()  # services started for the block: "s3" (see tests/test_docs_examples.py)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of one page, with the `<!-- docs-test: ... -->` marker just above it, if any."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip().splitlines()
        marker = _MARKER.search(before[-1]) if before else None
        tokens = (marker.group("args") if marker else "").split()
        needs = tuple(t for t in tokens if t in SERVICES)
        ranks = _ranks(" ".join(t for t in tokens if t not in SERVICES), path, match.start())
        code = textwrap.dedent("\n".join(line for line in match.group("body").splitlines()))
        line = text.count("\n", 0, match.start()) + 1
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        found.append(Block(name, line, match.group("lang").strip(), ranks, code + "\n", needs))
    return found


def _ranks(args: str, path: Path, offset: int) -> tuple[int, ...]:
    if not args:
        return (1,)
    m = re.fullmatch(r"ranks=(\d+(?:,\d+)*)", args)
    if not m:
        raise ValueError(
            f"{path.name} at char {offset}: unknown docs-test marker {args!r}; use 'ranks=2', 'ranks=1,2' and/or 's3'"
        )
    return tuple(int(n) for n in m.group(1).split(","))


def run_script_as_torchrun_rank(script: str, cwd: str) -> None:
    """Run a docs script on this rank the way `torchrun --nproc-per-node N script.py` would.

    As torchrun's agent does, rank 0 hosts the script's rendezvous store and every rank's
    `init_process_group` joins it as a client (TORCHELASTIC_USE_AGENT_STORE). The store listens on a port the
    kernel picks (port 0), which the launcher's process group carries to the other ranks before it is destroyed:
    no port is ever free between being picked and being bound, where another process could take it. The script
    initialises its own group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as under torchrun. All ranks share
    one working directory, as torchrun's ranks on one node do.
    """
    host = os.environ["MASTER_ADDR"]
    store = None  # rank 0's, held by this frame until the script is done
    if dist.get_rank() == 0:
        store = dist.TCPStore(host, 0, dist.get_world_size(), is_master=True, wait_for_workers=False)
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(True)
    os.chdir(cwd)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
