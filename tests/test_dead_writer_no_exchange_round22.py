"""A single-rank async save on a filesystem without an atomic exchange, whose writer is SIGKILLed in its replace.

Without renameat2 RENAME_EXCHANGE a replace is two renames: the old checkpoint to `.old_<id>_<pid>-<nonce>`, then
the new one into the id. The trainer settles the dead writer's save (`Commit.adopt`):

* killed between the two renames: the id holds nothing, the earlier checkpoint is aside. Before, the trainer said
  "NOT committed ... an earlier checkpoint at that id is intact" while a load of the id found nothing (the copy
  stayed aside until someone ran gc). Now it puts the earlier checkpoint back, and the id loads it.
* killed after the second rename, before the aside's removal: committed. Before, the trainer said it "finished
  the replaced checkpoint's removal" and left `.old_ck_<pid>-<nonce>` beside the id. Now it removes it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.commit_round18_jobs import wait_for_the_writer
from tests.memory_storage import Control, NoExchangeRecordingStorageConfig
from tests.test_dead_writer_single_rank_round22 import TIMEOUT_S, async_saves_through, killed_at, state
from torch_checkpointing import CheckpointManager
from torch_checkpointing.commit import Commit, CommitTarget
from torch_checkpointing.errors import WriterProcessDied
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CheckpointManager, Control]]:
    yield from async_saves_through(NoExchangeRecordingStorageConfig, tmp_path_factory)


def _loaded(path: Path) -> float:
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        return float(manager.load(str(path), {"model": {"w": torch.zeros(4)}})["model"]["w"][0])


def test_a_writer_killed_between_its_two_renames_leaves_the_earlier_checkpoint_at_the_id(
    saves: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, control = saves
    ck = tmp_path / "ck"
    manager.save(str(ck), state(1.0)).result(TIMEOUT_S)
    future, pid = killed_at(manager, control, f"after rename {ck} {tmp_path}/.old_ck_", ck, 2.0)
    with pytest.raises(WriterProcessDied) as raised:
        future.result(TIMEOUT_S)
    said = str(raised.value)
    assert "NOT committed" in said and str(ck) in said and str(pid) in said, said
    assert raised.value.outcome_unknown is False
    assert _loaded(ck) == 1.0  # the earlier checkpoint, at its id, as the error says
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_writer_killed_after_its_second_rename_is_committed_and_leaves_nothing_aside(
    saves: tuple[CheckpointManager, Control], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager, control = saves
    ck = tmp_path / "ck"
    manager.save(str(ck), state(1.0)).result(TIMEOUT_S)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        future, pid = killed_at(manager, control, f"before rmdir {tmp_path}/.old_ck_", ck, 3.0)
        assert future.result(TIMEOUT_S) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(pid) in r.getMessage()]
    assert warned and "committed" in warned[0], [r.getMessage() for r in caplog.records]
    assert _loaded(ck) == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the replaced checkpoint was removed


def test_a_later_save_after_a_writer_killed_between_its_renames_replaces_the_put_back_checkpoint(
    saves: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, control = saves
    ck = tmp_path / "ck"
    manager.save(str(ck), state(1.0)).result(TIMEOUT_S)
    future, _ = killed_at(manager, control, f"after rename {ck} {tmp_path}/.old_ck_", ck, 2.0)
    with pytest.raises(WriterProcessDied):
        future.result(TIMEOUT_S)
    wait_for_the_writer(manager)
    manager.save(str(ck), state(4.0)).result(TIMEOUT_S)
    assert _loaded(ck) == 4.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_an_aside_that_is_no_whole_checkpoint_is_not_put_back_and_a_warning_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Failed before: `Commit.adopt` returned without a word when the dead writer's copy aside was not a whole
    checkpoint (its manifest damaged), while the id held nothing."""
    pid = 4_000_001  # above any pid_max: no live process
    aside = tmp_path / f".old_ck_{pid}-0123abcd"
    aside.mkdir()
    (aside / "manifest.json").write_bytes(b'{"damaged')
    storage = LocalFileSystemStorageConfig(use_direct_io=False).create_storage()
    commit = Commit(storage, CommitTarget(str(tmp_path / "ck"), str(tmp_path / ".ck.tmp-0123abcd-1")))
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert commit.adopt(None, writer_pid=pid) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name]  # left for gc, not moved under the id
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(aside) in said and "gc" in said for said in warned), warned
