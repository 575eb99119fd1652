"""`latest_checkpoint` says when the step it read from an id's trailing integer puts an older save last.

Without `save(..., step=N)` the order comes from the id's trailing integer: `ckpt-2026-11-30` reads as step 30,
so a resume picked it over `ckpt-2026-12-01` (step 1), saved a day later, without a word.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, latest_checkpoint
from torch_checkpointing.config import SyncCheckpointSaverConfig

WORDS = "also its id's trailing integer"


@pytest.fixture
def manager() -> Iterator[CheckpointManager]:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
        yield m


def _save(manager: CheckpointManager, path: Path, step: int | None = None) -> None:
    manager.save(str(path), {"model": {"w": torch.zeros(2)}}, step=step)


def _latest_and_log(root: Path, caplog: pytest.LogCaptureFixture) -> tuple[str, str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        latest = latest_checkpoint(root)
    assert latest is not None
    return Path(latest.path).name, caplog.text


def test_an_older_save_that_wins_by_its_ids_number_is_named(
    tmp_path: Path, manager: CheckpointManager, caplog: pytest.LogCaptureFixture
) -> None:
    _save(manager, tmp_path / "run" / "ckpt-2026-11-30")
    _save(manager, tmp_path / "run" / "ckpt-2026-12-01")
    name, log = _latest_and_log(tmp_path / "run", caplog)
    assert name == "ckpt-2026-11-30"  # the documented order (by step, here read from the id) is kept
    assert WORDS in log and "ckpt-2026-12-01" in log and "step=N" in log


def test_recorded_steps_and_ids_in_order_say_nothing(
    tmp_path: Path, manager: CheckpointManager, caplog: pytest.LogCaptureFixture
) -> None:
    _save(manager, tmp_path / "a" / "step_2")
    _save(manager, tmp_path / "a" / "step_10")
    assert _latest_and_log(tmp_path / "a", caplog) == ("step_10", "")
    _save(manager, tmp_path / "b" / "ckpt-2026-11-30", step=30)
    _save(manager, tmp_path / "b" / "ckpt-2026-12-01", step=31)
    assert _latest_and_log(tmp_path / "b", caplog) == ("ckpt-2026-12-01", "")
    _save(manager, tmp_path / "c" / "best", step=9)  # steps that are not the ids' numbers were given
    _save(manager, tmp_path / "c" / "last", step=3)
    assert _latest_and_log(tmp_path / "c", caplog) == ("best", "")
