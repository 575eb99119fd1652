"""An HF export (`torch-checkpointing export --to hf`) ended by a signal while it writes its shards.

The export is written into a hidden staging folder beside its output and moved in whole; the documented promise
is that a killed export leaves no output, and that the staging folder of a SIGKILLed one is removed by the next
export beside it. Each test runs the real command in its own session and signals it once its staging folder
holds what the moment needs (polled, not timed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager

ROOT = Path(__file__).resolve().parent.parent
_SHARD = "32MB"  # 8 shards of one 32 MiB tensor each: a shard's write is under way most of the time


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("export_killed") / "ckpt"
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    try:
        manager.save(str(where), {"model": {f"layer{i}.w": torch.full((8 * 2**20,), float(i)) for i in range(8)}})
    finally:
        manager.close()
    return where


def _export(checkpoint: Path, out: Path) -> subprocess.Popen[str]:
    argv = ["-m", "torch_checkpointing", "export", "--item", "model", "--to", "hf", "--max-shard-size", _SHARD]
    return subprocess.Popen(
        [sys.executable, *argv, str(checkpoint), str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _stagings(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if ".export-tmp-" in p.name]


def _signal_when(proc: subprocess.Popen[str], parent: Path, ready: Callable[[Path], bool], signum: int) -> None:
    """Send `signum` to the export once its staging folder satisfies `ready` (fails if it never does)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = _stagings(parent)
        if found and ready(found[0]):
            os.killpg(proc.pid, signum)
            return
        time.sleep(0.002)
    _, err = proc.communicate(timeout=60)
    pytest.fail(f"the export never reached the moment to signal it (exit {proc.returncode}): {err[-2000:]}")


def _writing_a_shard(staging: Path) -> bool:
    """safetensors writes each shard to a `.tmpXXXXXX` file of its own and renames it: one is under way."""
    try:
        names = os.listdir(staging)
    except FileNotFoundError:
        return False
    return any(n.startswith(".tmp") for n in names) and any(n.endswith(".safetensors") for n in names)


def test_an_export_killed_while_safetensors_writes_a_shard_is_cleaned_up_by_the_next(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Defect: the next export left the dead export's staging folder (hundreds of MB) in place with a WARNING
    'it holds .tmpXXXXXX, which an export never writes': that file is safetensors' own temporary for the shard it
    was writing, there for most of an export's time."""
    out = tmp_path / "hf"
    killed = _export(checkpoint, out)
    _signal_when(killed, tmp_path, _writing_a_shard, signal.SIGKILL)
    killed.communicate(timeout=60)
    assert _stagings(tmp_path), "the SIGKILLed export left no staging folder: the test did not reach its moment"
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", "export", "--item", "model", "--to", "hf", str(checkpoint), out],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Left" not in done.stderr, done.stderr[-3000:]
    assert _stagings(tmp_path) == [], f"the dead export's staging folder is still there: {_stagings(tmp_path)}"


def test_a_sigterm_during_an_export_ends_it_with_143_and_nothing_left(checkpoint: Path, tmp_path: Path) -> None:
    """Defect: SIGTERM (`timeout`, a job scheduler, `kill`) killed the export outright: exit -15 and its staging
    folder, with the shards written so far, left beside the output (a Ctrl-C cleaned up and exited 130)."""
    out = tmp_path / "hf"
    proc = _export(checkpoint, out)
    _signal_when(proc, tmp_path, _writing_a_shard, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 143, f"exit code {proc.returncode}, stderr:\n{err[-3000:]}"
    assert len(lines) == 1 and "terminated" in lines[0], f"stderr should be one line, got:\n{err[-3000:]}"
    assert _stagings(tmp_path) == [], f"staging folder left behind: {_stagings(tmp_path)}"
    assert not out.exists()
