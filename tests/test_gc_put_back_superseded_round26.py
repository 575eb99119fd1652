"""gc moving a copy aside back under its id while a new save of that id commits.

A replace killed between its two renames leaves nothing at the id and the old checkpoint aside; gc moves that
copy back. A save of the id that commits meanwhile makes the copy garbage (the id holds a newer checkpoint).
Before, gc then reported the move failed ("rename it by hand", exit 1 of `gc`), asking a person to put an old
checkpoint over a newer one; on an object store, where a move is a copy under a claim at the id, the copy went
over the new save's files and its manifest, and the id loaded the old state. Now the move never lands on a
committed checkpoint, and the copy is collected as the garbage it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.s3_server import S3Server
from tests.test_objstore_round21 import _dead_pid
from tests.test_s3_attacks import state, sync_manager
from torch_checkpointing import CheckpointManager, RetentionPolicy, SyncCheckpointSaverConfig
from torch_checkpointing.discovery import storage_for
from torch_checkpointing.names import host_tag, trash_name
from torch_checkpointing.retention import collect_garbage, prune
from torch_checkpointing.storage.base_storage import Storage

_ASIDE = ".old_step_9_999999"  # a replace killed between its two renames (pid 999999: no process of this host)


def _commit_first(storage: Storage, manager: CheckpointManager, run: str) -> list[tuple[Path, Path]]:
    """Make `storage.rename` commit a new save of `run/step_9` (value 10) right before it moves anything there."""
    moves: list[tuple[Path, Path]] = []
    rename = storage.rename

    def racing(src: Path, dst: Path, *args: Any, **kwargs: Any) -> None:
        if Path(dst).name == "step_9" and not moves:
            manager.save(f"{run}/step_9", state(10.0))
        moves.append((Path(src), Path(dst)))
        rename(src, dst, *args, **kwargs)

    storage.rename = racing  # type: ignore[method-assign]
    return moves


def _check(run: str, storage: Storage, manager: CheckpointManager) -> None:
    moves = _commit_first(storage, manager, run)
    report = collect_garbage(run, storage, unowned_after_s=0)
    assert moves and moves[0][1].name == "step_9", moves  # gc did try to move the copy back
    assert report.failed == [], report.failed  # before: "could not move ... back ...: rename it by hand"
    assert [Path(lo.path).name for lo in report.removed] == [_ASIDE], report  # garbage once the id is re-saved
    assert float(manager.load(f"{run}/step_9")["model"]["w"][0]) == 10.0  # the new save, whole


def test_local(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(f"{run}/step_9", state(9.0))
        Path(f"{run}/step_9").rename(f"{run}/{_ASIDE}")
        _check(run, storage_for(run), manager)


def test_s3(s3_server: S3Server) -> None:
    pytest.importorskip("s3fs")
    config = s3_server.config()
    storage = config.create_storage()
    fs, bucket = storage.fs, config.url.split("://", 1)[1]
    with sync_manager(config) as manager:
        manager.save("run/step_9", state(9.0))
        for key in fs.find(f"{bucket}/run/step_9"):
            fs.cp_file(key, key.replace("/step_9/", f"/{_ASIDE}/"))
        storage.rmdir(Path("run/step_9"))
        _check(f"{config.url}/run", storage, manager)


@dataclass(frozen=True)
class TwoSaves:
    """`run/step_1` (1.0) and `run/step_2` (2.0) committed by the open `manager`; `rename` is `storage.rename`
    as it was, for a test's wrapper around it to call."""

    run: str
    manager: CheckpointManager
    storage: Storage
    rename: Callable[..., None]


@pytest.fixture
def two_saves(tmp_path: Path) -> Iterator[TwoSaves]:
    """The two checkpoints retention starts from here (keep_last=1 chooses step_1), and the manager that re-saves."""
    run = str(tmp_path / "run")
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(f"{run}/step_1", state(1.0))
        manager.save(f"{run}/step_2", state(2.0))
        storage = storage_for(run)
        yield TwoSaves(run, manager, storage, storage.rename)


def test_retention_never_asks_to_put_an_older_copy_over_a_newer_save(two_saves: TwoSaves) -> None:
    """Retention's delete of `step_1` finds it re-saved as it moves it to the trash, and moves it back; a third
    save of `step_1` commits before that move back. Before, the report said "could not be moved back: rename it
    back by hand" (a person doing so puts the older copy over the newer save), and the trash kept the copy."""
    run, manager, storage, seen = two_saves.run, two_saves.manager, two_saves.storage, []

    def resaved_first(src: Path, dst: Path, *args: Any, **kwargs: Any) -> None:
        if "step_1" in (Path(src).name, Path(dst).name):
            seen.append(Path(dst).name)
            manager.save(f"{run}/step_1", state(float(len(seen) + 6)))  # 7.0, then 8.0
        two_saves.rename(src, dst, *args, **kwargs)

    storage.rename = resaved_first  # type: ignore[method-assign]
    report = prune(run, RetentionPolicy(keep_last=1), storage)
    assert seen[-1] == "step_1", seen  # the move back was tried
    assert report.failed == [], report.failed
    assert sorted(os.listdir(run)) == ["step_1", "step_2"]  # no copy left aside
    assert float(manager.load(f"{run}/step_1")["model"]["w"][0]) == 8.0


def test_retention_keeps_a_users_file_in_a_copy_a_new_save_superseded(two_saves: TwoSaves) -> None:
    """Round 26 review. An eval job writes `eval.json` into `step_1` as retention moves it to the trash; the
    retention sees it there and moves the checkpoint back, since deleting it would delete that file. A new save of
    `step_1` commits first, so the move back is refused. Before, the copy was "garbage" and went, `eval.json` with
    it, at INFO, in no report: a user's file deleted by the very step that had refused to delete it."""
    run, manager, storage, seen = two_saves.run, two_saves.manager, two_saves.storage, []

    def late_file_then_resave(src: Path, dst: Path, *args: Any, **kwargs: Any) -> None:
        seen.append(Path(dst).name)
        if Path(src).name == "step_1":  # the eval job's file lands after retention's check, before its rename
            Path(src, "eval.json").write_text('{"loss": 0.5}')
        elif Path(dst).name == "step_1":  # the move back: a new save of the id commits first
            manager.save(f"{run}/step_1", state(8.0))
        two_saves.rename(src, dst, *args, **kwargs)

    storage.rename = late_file_then_resave  # type: ignore[method-assign]
    report = prune(run, RetentionPolicy(keep_last=1), storage)
    assert seen[-1] == "step_1", seen  # the move back was tried
    kept = list(Path(run).rglob("eval.json"))
    assert [p.read_text() for p in kept] == ['{"loss": 0.5}'], sorted(os.listdir(run))  # before: []
    (failed,) = report.failed  # a person must move the file out: the report says where it is
    assert "eval.json" in failed[1] and str(kept[0].parent.name) in failed[1], failed
    assert "rename it back" not in failed[1], failed  # never: that puts the older copy over the new save
    assert float(manager.load(f"{run}/step_1")["model"]["w"][0]) == 8.0


def test_gc_keeps_a_trash_copy_holding_a_users_file(tmp_path: Path) -> None:
    """Round 26 review. Retention keeps a copy in its trash when it holds a file that is not part of it (the case
    above), and tells the user to move the file out. gc collected every trash of a dead owner whole: the next
    job's gc deleted the user's file all the same. A trash holding only its checkpoint still goes (control)."""
    run = tmp_path / "run"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(run / "step_1"), state(1.0))
        manager.save(str(run / "step_2"), state(2.0))
        manager.save(str(run / "step_3"), state(3.0))
    dead = _dead_pid()
    with_file, plain = (run / trash_name(f"step_{i}", dead, "abcdef01", host_tag()) for i in (1, 2))
    (run / "step_1").rename(with_file)
    (with_file / "eval.json").write_text('{"loss": 0.5}')
    (run / "step_2").rename(plain)
    report = collect_garbage(str(run), storage_for(str(run)), unowned_after_s=0)
    assert (with_file / "eval.json").read_text() == '{"loss": 0.5}'  # before: FileNotFoundError, the trash gone
    assert [(Path(lo.path).name, "eval.json" in why) for lo, why in report.kept] == [(with_file.name, True)], report
    assert [Path(lo.path).name for lo in report.removed] == [plain.name], report
