"""The CLI's operations (`ls`, `inspect`, `prune`, `diff`, `gc`, `export`) as an operator runs them, through the
real command (`python -m torch_checkpointing`).

Before: `--json` wrote a NaN or infinite metric (a diverged loss, which `save(metrics=...)` takes and the manifest
records as the string "NaN") as the bare tokens `NaN` and `Infinity`, which are not JSON: `jq` and every strict
parser refused the whole document.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("round28") / "run"
    metrics = [{"loss": float("nan"), "acc": float("inf")}, {"loss": 1.0, "acc": float("-inf")}]
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step, recorded in enumerate(metrics, 1):
            manager.save(str(run / f"step_{step}"), {"model": {"w": torch.ones(4)}}, step=step, metrics=recorded)
    return run


def _cli(*args: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )
    assert done.returncode == expect, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _strict(text: str) -> Any:
    """Parse as a strict JSON parser (jq, JavaScript's JSON.parse) does: no NaN/Infinity tokens."""

    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    "argv",
    [["ls", "{root}"], ["inspect", "{root}/step_1"], ["prune", "{root}", "--keep-last", "1", "--dry-run"]],
    ids=["ls", "inspect", "prune"],
)
def test_json_output_writes_non_finite_metrics_as_the_manifest_does(root: Path, argv: list[str]) -> None:
    """Failed before: "ValueError: Infinity is not JSON" for each (`"acc": Infinity, "loss": NaN` on stdout)."""
    doc = _strict(_cli("--json", *(a.format(root=root) for a in argv)).stdout)
    found = json.dumps(doc)
    assert '"loss": "NaN"' in found and '"acc": "Infinity"' in found, found


_DIFF_UNDER_LIMITS = """
import contextlib, io, resource, sys, torch
from torch_checkpointing import CheckpointManager, ItemSpec, cli
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
root = sys.argv[1]
items = {"st": ItemSpec(layout=LayoutInfo("st_{rank}.safetensors", SafetensorsSerialization()))}
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), items=items)) as m:
    for name, fill in (("a", 1.0), ("b", 2.0)):
        values = torch.full((24 << 20,), fill)
        m.save(f"{root}/{name}", {"st": {"w": values}, "t": {"x": values.clone()}})

def run(argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            return str(cli.main(argv)), err.getvalue()
        except BaseException as exc:  # what the interpreter would print as a traceback, exiting 1
            return f"uncaught-{type(exc).__name__}", repr(exc)

argv = ["diff", f"{root}/a", f"{root}/b"]
assert run(argv)[0] == "1", run(argv)  # every import diff needs, with memory to spare; the two differ
base = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
for room in range(0, 577, 48):  # MiB of address space beyond what the process holds
    resource.setrlimit(resource.RLIMIT_AS, (base + room * 2**20, resource.RLIM_INFINITY))
    try:
        code, said = run(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(room, code, repr(said.strip()[:2000]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's")
def test_diff_out_of_memory_names_the_file_and_says_it_is_not_damage(tmp_path: Path) -> None:
    """Every run of `diff` under a memory limit ends 1 (the answer) or 2 naming a file of either checkpoint and
    saying the checkpoint was not found damaged.

    Failed before: "0 2 'torch-checkpointing diff: error: [Errno 12] Cannot allocate memory'" (the CRC32 check's
    map of a file), "256 2 '... error: unable to mmap 100663376 bytes from file </proc/self/fd/4>: Cannot allocate
    memory (12)'" (a safetensors item) and "384 2 '... DefaultCPUAllocator: can't allocate memory ...'" (the
    comparison): no file named, nothing said of damage."""
    done = subprocess.run(
        [sys.executable, "-c", _DIFF_UNDER_LIMITS, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S * 2,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    short = [line for line in lines if line.split()[1] == "2"]
    assert short, f"no limit was low enough to show anything: {lines}"
    wrong = [line for line in lines if line.split()[1] not in ("1", "2")]
    wrong += [line for line in short if "not found damaged" not in line or str(tmp_path) not in line]
    assert not wrong, "\n".join(wrong)
