"""A load of an id whose replace was killed between its two renames names the copy left beside it.

Before, the error said only "does not exist", though the committed checkpoint sat beside its id under `.old_`.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_long_names_and_removal import LONG, _dead_pid, _killed_replace, _manager
from torch_checkpointing.discovery import latest_checkpoint, list_checkpoints
from torch_checkpointing.names import aside_name


def test_the_not_found_error_names_the_previous_copy_and_the_gc_that_moves_it_back(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "step_1"
    _killed_replace(ckpt)
    (aside,) = [p for p in ckpt.parent.iterdir() if p.name.startswith(".old_")]
    hint = rf"Its previous checkpoint is at .*{aside.name}"
    with _manager() as manager, pytest.raises(FileNotFoundError, match=rf"does not exist\. {hint}"):
        manager.load(str(ckpt), into={"model": {"w": torch.zeros(4)}})
    assert f"torch-checkpointing gc {ckpt.parent}" in _message(ckpt)  # the self-describing load (no into=) too


def test_an_unrelated_missing_id_gets_no_hint(tmp_path: Path) -> None:
    (tmp_path / ".old_other_123").mkdir()
    with _manager() as manager, pytest.raises(FileNotFoundError) as info:
        manager.load(str(tmp_path / "step_1"))
    assert "previous checkpoint" not in str(info.value)


def _message(ckpt: Path) -> str:
    with _manager() as manager, pytest.raises(FileNotFoundError) as info:
        manager.load(str(ckpt))
    return str(info.value)


def test_latest_checkpoint_says_when_the_newest_sits_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before, `latest_checkpoint` went back to step 0 without a word while step 1's copy sat aside."""
    with _manager() as manager:
        manager.save(str(tmp_path / "run" / "step_0"), {"model": {"w": torch.zeros(4)}}, step=0)
    _killed_replace(tmp_path / "run" / "step_1")
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        latest = latest_checkpoint(tmp_path / "run")
    assert latest is not None and latest.step == 0  # what is listed is unchanged ...
    said = [r.getMessage() for r in caplog.records if "previous copy" in r.getMessage()]
    assert len(said) == 1 and "step_1 is missing" in said[0] and "gc" in said[0]  # ... and it is said


def test_a_cut_aside_copy_whose_long_id_is_there_is_not_reported_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An aside name cut to fit NAME_MAX names its id only in part: the id is found among the siblings, so a
    leftover copy beside a checkpoint that is there is not reported as the only copy of a missing one."""
    ckpt = tmp_path / LONG
    with _manager() as manager:
        manager.save(str(ckpt), {"model": {"w": torch.zeros(4)}}, step=1)
    shutil.copytree(ckpt, tmp_path / aside_name(LONG, _dead_pid(), "0a1b2c3d"))
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        listed = list_checkpoints(tmp_path)
    assert [c.name for c in listed] == [LONG]
    assert not [r for r in caplog.records if "previous copy" in r.getMessage()]
