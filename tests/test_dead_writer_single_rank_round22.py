"""A single-rank async save whose writer process is SIGKILLed in the commit ends with a known outcome.

* Killed while it writes the manifest (nothing in place yet): the save's Future fails saying the checkpoint was
  NOT committed, the id still loads the earlier checkpoint, and nothing of the failed save is left beside it.
* Killed right after it swapped the checkpoint into place (the replaced one still at its temporary name): the
  checkpoint is committed, so the Future succeeds, a WARNING names the dead writer, and the replaced checkpoint
  is gone.

Before, both ended as `WriterProcessDied` saying the outcome was unknown ("The id holds its previous checkpoint,
or this one"): with one rank there is no store, so the trainer did not know which manifest its writer was
writing. The writer now tells it over the pipe before it writes the manifest (`checkpoint_process.Publishing`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.commit_round18_jobs import wait_for_the_writer
from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import WriterProcessDied

TIMEOUT_S = 120


def async_saves_through(
    storage_config: type[RecordingStorageConfig], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[CheckpointManager, Control]]:
    """An async manager whose writer's storage calls the test can hold (`Control.block`), and that control."""
    control = Control(tmp_path_factory.mktemp("control"))
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = storage_config(control_dir=str(control.root))
    manager = CheckpointManager(config)
    yield manager, control
    control.reset()
    manager.close()


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CheckpointManager, Control]]:
    yield from async_saves_through(RecordingStorageConfig, tmp_path_factory)


def state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((4,), value)}}


def _loaded(manager: CheckpointManager, path: Path) -> float:
    return float(manager.load(str(path), {"model": {"w": torch.zeros(4)}})["model"]["w"][0])


def killed_at(manager: CheckpointManager, control: Control, moment: str, path: Path, value: float) -> Any:
    """Save `path` again; the writer blocks at `moment` of its commit and is SIGKILLed there. The save's Future."""
    wait_for_the_writer(manager)  # the writer killed by the test before: its replacement
    control.block(moment)
    try:
        future = manager.save(str(path), state(value))
        pid = control.wait_blocked(TIMEOUT_S)
        assert pid == manager.writer_pid, (pid, manager.writer_pid)  # the writer, not the trainer
        os.kill(pid, signal.SIGKILL)
    finally:
        control.reset()
    return future, pid


def test_a_writer_killed_writing_the_manifest_commits_nothing_and_the_error_says_so(
    saves: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, control = saves
    ck = tmp_path / "ck"
    manager.save(str(ck), state(1.0)).result(TIMEOUT_S)
    future, pid = killed_at(manager, control, "manifest", ck, 2.0)
    with pytest.raises(WriterProcessDied) as raised:
        future.result(TIMEOUT_S)
    said = str(raised.value)
    assert "NOT committed" in said and str(ck) in said and str(pid) in said, said
    assert "or this one" not in said, said  # not "unknown": the trainer looked
    assert raised.value.outcome_unknown is False
    assert _loaded(manager, ck) == 1.0  # the earlier checkpoint, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # nothing of the failed save beside it


def test_a_writer_killed_after_the_swap_is_a_committed_save(
    saves: tuple[CheckpointManager, Control], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager, control = saves
    ck = tmp_path / "ck"
    manager.save(str(ck), state(1.0)).result(TIMEOUT_S)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        future, pid = killed_at(manager, control, "before rmdir", ck, 3.0)
        assert future.result(TIMEOUT_S) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(pid) in r.getMessage()]
    assert warned and "committed" in warned[0] and str(ck) in warned[0], [r.getMessage() for r in caplog.records]
    assert _loaded(manager, ck) == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the replaced checkpoint was removed


# ------------------------------------------- a wait that timed out and killed a writer that had committed


def _loaded_by_a_new_manager(path: Path) -> float:
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        return _loaded(manager, path)


@pytest.mark.parametrize("how", ["close()", "the next save()"])
def test_a_wait_that_timed_out_and_killed_a_writer_that_had_swapped_the_checkpoint_in_says_it_is_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """The writer stops after its swap (the replaced checkpoint still at its temporary name) until the wait gives
    up and kills it; the trainer then finds the checkpoint in place and the save's Future succeeds. What close(),
    or the next save(), says must agree: before, they raised "... was not committed" for that committed save."""
    control, runs = Control(tmp_path / "control"), tmp_path / "runs"
    runs.mkdir()
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = RecordingStorageConfig(control_dir=str(control.root))
    config.save.wait_timeout_secs = 2
    manager = CheckpointManager(config)
    try:
        wait_for_the_writer(manager)
        manager.save(str(runs / "ck"), state(1.0)).result(TIMEOUT_S)
        control.block("before rmdir")
        future = manager.save(str(runs / "ck"), state(2.0))
        assert control.wait_blocked(TIMEOUT_S) == manager.writer_pid
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            if how == "close()":
                manager.close()
            else:
                manager.save(str(runs / "next"), state(5.0)).result(TIMEOUT_S)
        assert future.result(0) is None
    finally:
        control.reset()
        manager.close()
    said = [r.getMessage() for r in caplog.records if "did not finish within 2" in r.getMessage()]
    assert said and "killed" in said[0] and "committed" in said[0] and "not committed" not in said[0], said
    assert _loaded_by_a_new_manager(runs / "ck") == 2.0
    assert sorted(p.name for p in runs.iterdir()) == ["ck"] + (["next"] if how != "close()" else [])


# ------------------------------------------- the trainer cannot read the id's manifest when it looks


def test_a_trainer_that_cannot_read_the_manifest_at_the_id_does_not_say_not_committed(
    saves: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    """The writer swapped the checkpoint in, then was killed; the trainer's read of the id's manifest fails (EIO).
    Before, `Commit.adopt` took the unreadable manifest for "none there": the Future said "NOT committed ... an
    earlier checkpoint at that id is intact" while the id loaded the new checkpoint. Whether it was committed is
    not known to the trainer then, and the error must say so; nothing at the id is removed."""
    manager, control = saves
    ck = tmp_path / "ck"
    manager.save(str(ck), state(1.0)).result(TIMEOUT_S)
    wait_for_the_writer(manager)
    control.block("before rmdir")
    try:
        future = manager.save(str(ck), state(6.0))
        pid = control.wait_blocked(TIMEOUT_S)
        assert pid == manager.writer_pid, (pid, manager.writer_pid)
        control.fail_reads(os.getpid(), f"{ck}/manifest.json")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WriterProcessDied) as raised:
            future.result(TIMEOUT_S)
    finally:
        control.reset()
    said = str(raised.value)
    assert "NOT committed" not in said, said
    assert raised.value.outcome_unknown is True, said
    assert _loaded(manager, ck) == 6.0  # it was committed: the error must not have said otherwise
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
