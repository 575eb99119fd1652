"""Probes the tests share to look at the process from outside the engine's API.

* `memory_maps()`: this process's memory mappings, read from /proc/self/maps, to see which files (staging
  slabs, memory-mapped checkpoint files) are mapped right now, without asking the engine.
* `run_fresh()`, `fresh_json()`, `modules_after()`: run code in a new interpreter, where nothing of the package
  is imported yet, to see what an import loads or starts; this test process has long since imported it all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["REPO", "MappedRegion", "fresh_json", "memory_maps", "modules_after", "run_fresh"]

REPO = Path(__file__).resolve().parents[1]
FRESH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class MappedRegion:
    """One line of /proc/self/maps: an address range and what backs it (`path` is "" for anonymous memory)."""

    start: int
    end: int
    perms: str
    inode: str
    path: str


def _region(line: str) -> MappedRegion:
    # address perms offset dev inode [path]; the path may hold spaces (and ends " (deleted)" once unlinked)
    fields = line.split(maxsplit=5)
    start, end = (int(x, 16) for x in fields[0].split("-"))
    path = fields[5].strip() if len(fields) > 5 else ""
    return MappedRegion(start, end, fields[1], fields[4], path)


def memory_maps() -> list[MappedRegion]:
    """Every mapping of this process, in address order, read now."""
    return [_region(line) for line in Path("/proc/self/maps").read_text().splitlines() if line]


def run_fresh(code: str, *args: str, timeout: float = FRESH_TIMEOUT_S) -> str:
    """Run `code` (dedented; `args` are its sys.argv[1:]) in a new interpreter from the checkout's root and
    return what it printed. A probe that exits non-zero fails the test with its output, not a bare status."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"the probe exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def fresh_json(code: str, *args: str, timeout: float = FRESH_TIMEOUT_S) -> Any:
    """The last line `code` printed in a new interpreter, parsed as JSON (earlier lines are free for logs)."""
    lines = run_fresh(code, *args, timeout=timeout).strip().splitlines()
    assert lines, "the probe printed nothing"
    return json.loads(lines[-1])


def modules_after(code: str, *, timeout: float = FRESH_TIMEOUT_S) -> set[str]:
    """The names in sys.modules once a new interpreter has run `code`."""
    report = "import json as _json, sys as _sys\nprint(_json.dumps(sorted(_sys.modules)))\n"
    return set(fresh_json(textwrap.dedent(code) + "\n" + report, timeout=timeout))
