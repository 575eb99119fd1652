"""The retention pass a manager runs after each commit shows what its gc kept, and why, in the training log.

Before, `RetentionRunner` dropped gc's report: a leftover kept for a reason only a person can act on (a folder
named like ours that holds something else, a copy that is the only one of its checkpoint, an age that could not
be told) showed only in the `gc` command, never on the `torch_checkpointing` logger, so a job that never runs
that command kept it for good, unseen.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, LocalFileSystemStorageConfig, RetentionPolicy
from torch_checkpointing.manifest import INCOMPLETE_MARKER


def _manager(policy: RetentionPolicy) -> CheckpointManager:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.retention = policy
    return CheckpointManager(config)


def test_what_the_automatic_gc_keeps_for_a_person_to_look_at_is_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Named like a trash of ours, holding a user's file and nothing of ours: gc keeps it, "delete it by hand".
    strange = tmp_path / ".step_0.trash-999999-abcd"
    strange.mkdir()
    (strange / "notes.txt").write_text("mine")
    caplog.set_level(logging.INFO, logger="torch_checkpointing")
    with _manager(RetentionPolicy(keep_last=2)) as manager:
        for step in (1, 2, 3):
            manager.save(str(tmp_path / f"step_{step}"), {"w": torch.full((8,), float(step))})
    said = [r for r in caplog.records if str(strange) in r.getMessage()]
    assert said, "gc's report was dropped: nothing named the leftover it kept"
    warned = [r for r in said if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in said]  # once, not at every pass
    assert "delete it by hand" in warned[0].getMessage(), warned[0].getMessage()
    assert (strange / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_2", "step_3"]


def test_a_kept_leftover_whose_reason_names_its_age_is_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Round 26 review: the reason `unowned_after_s=inf` keeps another host's temporary names its age ("(12s
    old), kept for good"), which grows between passes: taken whole as what was told, a new WARNING came at every
    save for the same leftover, kept for the same reason."""
    temporary = tmp_path / ".step_7.tmp-0123456789ab-1"  # a save from another host (no lock file of it here)
    temporary.mkdir()
    (temporary / INCOMPLETE_MARKER).touch()
    caplog.set_level(logging.INFO, logger="torch_checkpointing")
    with _manager(RetentionPolicy(keep_last=2, unowned_after_s=math.inf)) as manager:
        for step in (1, 2, 3):
            manager.save(str(tmp_path / f"step_{step}"), {"w": torch.full((8,), float(step))})
            time.sleep(1.1)  # a job's saves are minutes apart: the age the reason names differs at each pass
    said = [r for r in caplog.records if str(temporary) in r.getMessage()]
    assert len(said) == 3, [r.getMessage() for r in said]  # one line per pass
    warned = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned  # before: three WARNINGs, "(0s old)", "(1s old)", "(2s old)"
    assert "kept for good" in warned[0], warned
    assert temporary.is_dir()
