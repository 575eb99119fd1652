"""Retention is per root: two managers with a RetentionPolicy on one root prune each other's checkpoints.

docs/operations.md and docs/guide.md say so, and that each job needs a root of its own; this checks the
sentence with real managers (two jobs saving in turn under one directory), and the fix it gives.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from torch_checkpointing import CheckpointManager, RetentionPolicy
from torch_checkpointing.config import SyncCheckpointSaverConfig


def _manager() -> CheckpointManager:
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), retention=RetentionPolicy(keep_last=2))
    return CheckpointManager(config)


def _two_jobs(root_a: Path, root_b: Path) -> None:
    """Job A saves the odd steps, job B the even ones, in turn; each keeps its last 2, so it thinks."""
    with _manager() as a, _manager() as b:
        for step in range(1, 9, 2):
            a.save(str(root_a / f"job_a_step_{step}"), {"model": {"w": torch.ones(2)}}, step=step)
            b.save(str(root_b / f"job_b_step_{step + 1}"), {"model": {"w": torch.ones(2)}}, step=step + 1)
    # close() waited for every retention pass


def test_two_managers_with_retention_on_one_root_prune_each_others_checkpoints(tmp_path: Path) -> None:
    _two_jobs(tmp_path, tmp_path)
    # keep_last=2 kept the 2 newest of the root, whoever saved them: one of each job's, not two.
    assert sorted(os.listdir(tmp_path)) == ["job_a_step_7", "job_b_step_8"]


def test_a_root_of_its_own_keeps_each_jobs_checkpoints(tmp_path: Path) -> None:
    _two_jobs(tmp_path / "a", tmp_path / "b")
    assert sorted(os.listdir(tmp_path / "a")) == ["job_a_step_5", "job_a_step_7"]
    assert sorted(os.listdir(tmp_path / "b")) == ["job_b_step_6", "job_b_step_8"]
