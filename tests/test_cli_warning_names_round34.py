"""The CLI's WARNING lines show names as data (round 34).

Every line the CLI prints shows a name with its non-printable characters escaped, but its WARNINGs (a
checkpoint skipped as a resume point, a damaged manifest) reached stderr through Python's last-resort
handler as they were: a checkpoint named with an escape sequence drove the terminal from `ls`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 120  # the CLI takes seconds (importing torch); this only stops a hang


def test_a_warning_naming_a_checkpoint_escapes_its_name(tmp_path: Path) -> None:
    root = tmp_path / "run"
    name = "step_1\x1b[31mEVIL"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(root / name), {"model": {"w": torch.ones(2)}})
    (root / name / "model_0.pt").unlink()  # damaged: `ls` warns that it is no resume point, naming it
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", "ls", str(root)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert "resume point" in done.stderr and "step_1\\x1b[31mEVIL" in done.stderr, done.stderr
    assert "\x1b" not in done.stderr + done.stdout, (done.stderr, done.stdout)
