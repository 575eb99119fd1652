"""docs/examples/train_resume.py: SIGKILLed mid-run, resumed from the latest checkpoint, ends bit-identical."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from torch_checkpointing import CheckpointManager, latest_checkpoint, list_checkpoints
from torch_checkpointing.discovery import list_leftovers

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "train_resume.py"
ARGS = ["--steps", "40", "--save-every", "5"]


def _run(root: Path, *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--root", str(root), *ARGS, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _digest(out: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith("final digest ")]
    return line.split()[-1]


def _kill_after_a_commit(root: Path) -> None:
    """Start a slow run in its own process group; SIGKILL the whole group (trainer and writer) mid-run."""
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--root", str(root), *ARGS, "--step-delay", "0.2"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            latest = latest_checkpoint(root)
            if latest is not None and latest.step is not None and latest.step >= 10:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it could be killed; slow it down"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    assert proc.returncode == -signal.SIGKILL


def test_killed_run_resumes_from_latest_and_ends_bit_identical(tmp_path: Path) -> None:
    straight = _digest(_run(tmp_path / "straight"))
    crashed = tmp_path / "crashed"
    _kill_after_a_commit(crashed)
    killed_at = latest_checkpoint(crashed)
    assert killed_at is not None and killed_at.step is not None and killed_at.step < 40
    out = _run(crashed)
    assert f"resumed from {killed_at.name} (step {killed_at.step})" in out
    assert _digest(out) == straight
    # Retention ran on the resumed run: the last two plus the best by loss, nothing left over from the kill.
    found = list_checkpoints(crashed)
    assert found[-1].step == 40 and len(found) <= 3 and list_leftovers(crashed) == []
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as m:
        a = m.load(str(tmp_path / "straight" / "step_000040"))
        b = m.load(found[-1].path)
    for key in ("model",):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key])
    assert torch.equal(a["rng"], b["rng"]) and a["progress"] == b["progress"] == {"step": 40}
