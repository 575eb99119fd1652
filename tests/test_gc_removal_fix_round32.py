"""A leftover gc cannot remove because the OS refuses it (a file set immutable, a folder another user owns) is
reported with the fix, not with "`torch-checkpointing gc` will retry": a retry meets the same refusal until
someone lifts it, and a cron job's report said only that it would try again.

Real refusals: `chattr +i` on a file of the pruned checkpoint (EPERM, even for root), and gc run as an
unprivileged user on a folder root owns (EACCES).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.test_gc_failure_reasons_round25 import CHILD, blocked_leftover  # noqa: F401  (a fixture)
from tests.test_unreadable_files_round24 import run_as_nobody
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy, collect_garbage, prune


def _immutable(path: Path) -> bool:
    """Set `path` immutable; False where this filesystem or user cannot (tmpfs, no CAP_LINUX_IMMUTABLE)."""
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def test_gc_names_the_attribute_that_blocks_a_removal(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2):
            manager.save(str(root / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)
    blocked = root / "step_1" / "m_0.pt"
    if not _immutable(blocked):
        pytest.skip("chattr +i is not available on this filesystem or to this user")
    try:
        prune(root, RetentionPolicy(keep_last=1))
        report = collect_garbage(root, unowned_after_s=0.0)
        ((_, why),) = report.failed
        assert "Operation not permitted" in why and "lsattr" in why and "chattr -i" in why, why
        assert "will retry" not in why, why
    finally:
        for trash in root.glob(".step_1.*/m_0.pt"):
            subprocess.run(["chattr", "-i", str(trash)], check=True)


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0, reason="needs root")
def test_gc_names_the_owner_when_a_removal_is_denied(blocked_leftover: Path) -> None:  # noqa: F811
    out = run_as_nobody(CHILD, str(blocked_leftover))
    (failed,) = json.loads(out["--json"]["stdout"])["failed"]
    assert "Permission denied" in failed["reason"] and "owner" in failed["reason"], failed
    assert "will retry" not in failed["reason"], failed
