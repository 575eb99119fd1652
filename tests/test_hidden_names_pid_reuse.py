"""Hidden names left by a killed process whose pid this process now has (a job restarted in a container).

A container's job gets the same small pid after every restart. Before the fix, the non-exchange replace moved
the old checkpoint to `.old_<id>_<pid>`: a replace killed between its two renames left that name behind, and
the restarted job's next replace of the id tried to move the old checkpoint to the very same name, which was
taken (ENOTEMPTY), so every later save of the id failed with a CommitError until the job ended. And gc, run by
the restarted job, took the dead process's `.old_` and `.trash-` names for its own work in flight (the pid is
alive: it is this process) and never put the checkpoint back or removed the trash.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.names import ASIDE_RE, aside_of
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage import filesystem


def _manager() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((4,), value)}}


def _no_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """What NFS (or an old kernel) gives: no renameat2, so replace_directory falls back to two renames."""
    monkeypatch.setattr(filesystem, "_renameat2", lambda: None)


def _left_by_a_killed_process_of_my_pid(ckpt: Path) -> Path:
    """A copy of `ckpt` under the aside name a killed replace of an earlier version, same pid, left behind."""
    aside = ckpt.with_name(f".old_{ckpt.name}_{os.getpid()}")
    shutil.copytree(ckpt, aside)
    return aside


def test_a_replace_succeeds_beside_an_aside_a_killed_process_of_the_same_pid_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_exchange(monkeypatch)
    ckpt = tmp_path / "step_1"
    with _manager() as manager:
        manager.save(str(ckpt), _state(1.0), step=1)
        stale = _left_by_a_killed_process_of_my_pid(ckpt)
        manager.save(str(ckpt), _state(2.0), step=1)
        assert torch.equal(manager.load(str(ckpt))["model"]["w"], torch.full((4,), 2.0))
    assert (stale / "manifest.json").is_file()  # a copy of somebody's: only gc decides about it


def test_gc_puts_back_a_checkpoint_a_killed_process_of_the_same_pid_left_aside(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_1"
    with _manager() as manager:
        manager.save(str(ckpt), _state(1.0), step=1)
    aside = ckpt.with_name(f".old_{ckpt.name}_{os.getpid()}")
    os.rename(ckpt, aside)  # killed between the two renames: nothing at the id
    (leftover,) = list_leftovers(tmp_path)
    assert leftover.kind == "replaced" and leftover.owner_alive is False
    report = collect_garbage(tmp_path, unowned_after_s=0)
    assert report.failed == [] and sorted(os.listdir(tmp_path)) == ["step_1"], report
    with _manager() as manager:
        assert torch.equal(manager.load(str(ckpt))["model"]["w"], torch.full((4,), 1.0))


def test_gc_removes_trash_a_killed_process_of_the_same_pid_left(tmp_path: Path) -> None:
    with _manager() as manager:
        manager.save(str(tmp_path / "step_1"), _state(1.0), step=1)
    trash = tmp_path / f".step_1.trash-{os.getpid()}-0a1b2c3d"
    shutil.copytree(tmp_path / "step_1", trash)
    report = collect_garbage(tmp_path, unowned_after_s=0)
    assert [Path(lo.path).name for lo in report.removed] == [trash.name], report
    assert sorted(os.listdir(tmp_path)) == ["step_1"]


def test_gc_in_this_process_leaves_the_aside_of_a_replace_this_process_is_making(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard from the other side: between the two renames of a live replace, the id is empty and the old
    copy aside, exactly as a killed one leaves them; gc on another thread must neither restore nor remove it."""
    _no_exchange(monkeypatch)
    ckpt = tmp_path / "step_1"
    real_rename = filesystem.LocalFileSystemStorage.rename
    seen: list[Any] = []

    def gc_between_the_renames(self: Any, src: Path, dst: Path, *args: Any, **kwargs: Any) -> None:
        if Path(dst) == ckpt and ".tmp-" in Path(src).name and not ckpt.exists():
            worker = threading.Thread(target=lambda: seen.append(collect_garbage(tmp_path, unowned_after_s=0)))
            worker.start()
            worker.join(60)
        real_rename(self, src, dst, *args, **kwargs)

    with _manager() as manager:
        manager.save(str(ckpt), _state(1.0), step=1)
        monkeypatch.setattr(filesystem.LocalFileSystemStorage, "rename", gc_between_the_renames)
        manager.save(str(ckpt), _state(2.0), step=1)
        monkeypatch.undo()
        assert torch.equal(manager.load(str(ckpt))["model"]["w"], torch.full((4,), 2.0))
    (report,) = seen
    assert report.removed == [] and report.failed == [], report
    assert not any("moved back" in why for _, why in report.kept), report.kept
    assert sorted(os.listdir(tmp_path)) == ["step_1"]


@pytest.mark.parametrize(
    ("hidden", "name"),
    [
        (".old_step_1_77-0a1b2c3d", "step_1"),  # this version's names
        (".old_step_1_77", "step_1"),  # an earlier version's
        (".old_a_1-deadbeef_77", "a_1-deadbeef"),  # an earlier version's, for an id that looks like a nonce
        (".old_a_1-deadbeef_77-0a1b2c3d", "a_1-deadbeef"),
    ],
)
def test_aside_names_of_both_versions_name_their_id(hidden: str, name: str) -> None:
    assert ASIDE_RE.match(hidden) is not None and aside_of(hidden, []) == name
