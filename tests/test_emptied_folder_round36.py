"""What a directory store (fsspec `file://`, `memory://`) keeps at an id once a save's or a delete's claim goes.

Those stores stand in for an object store, whose prefix is gone with its last object. Here the id's folder
stayed: a save that failed let go of its claim (its files removed) and left an empty `step_1/`; gc collecting
what a killed save or a killed delete left removed the files and the claim and left the folder too. Nothing
listed it, but `ls` of the run showed a `step_1` that `inspect` called "not a checkpoint", and a user who deleted
a checkpoint found its folder still there. Now the folder goes with the claim when nothing else is in it; a
folder that holds a user's file stays, with the file.

Real processes (SIGKILLed at a chosen file operation), real files.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from tests.test_killed_delete_round35 import _CHILD as _KILLED_DELETE
from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import REPO, _env, _killed_save, _plain_manager, _run_until_sigkilled
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")


def _gc(url: str) -> None:
    report = collect_garbage(url, FsspecStorageConfig(url=url).create_storage(), unowned_after_s=0)
    assert not report.failed and not report.kept, report


def _saved_again(url: str) -> None:
    """The id is free: a save of it commits and lists."""
    with _plain_manager(url) as manager:
        manager.save("step_1", {"model": {"w": torch.arange(3.0)}})
    assert [Path(i.path).name for i in list_checkpoints(url, FsspecStorageConfig(url=url).create_storage())] == [
        "step_1"
    ]


# The delete killed among the id's files (claim and manifest left), and right before its last step (the claim
# alone left): the next gc removes the rest.
@pytest.mark.parametrize(("op", "name", "nth"), [("rm", "x_0.pt", 1), ("rm", ".incomplete", 2)])
def test_gc_after_a_killed_delete_leaves_no_folder_at_the_id(tmp_path: Path, op: str, name: str, nth: int) -> None:
    url = _root_url("file", tmp_path)
    _run_until_sigkilled(_KILLED_DELETE, url, "step_1", op, name, str(nth))
    _gc(url)
    assert os.listdir(tmp_path / "run") == []
    _saved_again(url)


def test_gc_after_a_killed_save_leaves_no_folder_at_the_id(tmp_path: Path) -> None:
    url = _root_url("file", tmp_path)
    _killed_save(url, "step_1", user={})
    assert os.listdir(tmp_path / "run") == ["step_1"]
    _gc(url)
    assert os.listdir(tmp_path / "run") == []


def test_a_users_file_keeps_the_folder_gc_collected(tmp_path: Path) -> None:
    url = _root_url("file", tmp_path)
    _killed_save(url, "step_1", user={"NOTES.txt": b"do not delete"})
    collect_garbage(url, FsspecStorageConfig(url=url).create_storage(), unowned_after_s=0)
    assert (tmp_path / "run" / "step_1" / "NOTES.txt").read_bytes() == b"do not delete"


class _FullDiskLocal(LocalFileSystem):
    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if os.path.basename(path) == "x_0.pt" and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super()._open(path, mode, **kwargs)


class _FullDiskMemory(MemoryFileSystem):
    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if os.path.basename(path) == "x_0.pt" and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super()._open(path, mode, **kwargs)


@pytest.mark.parametrize("store", ["file", "memory"])
def test_a_failed_save_leaves_no_folder_at_the_id(tmp_path: Path, store: str) -> None:
    url = _root_url(store, tmp_path)
    failing = _FullDiskLocal() if store == "file" else _FullDiskMemory()
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url, filesystem=failing)
    )
    with CheckpointManager(config) as manager, pytest.raises(CheckpointError, match="No space left"):
        manager.save("step_1", {"model": {"w": torch.arange(4.0)}, "x": 1})
    storage = FsspecStorageConfig(url=url).create_storage()
    assert storage.ls(Path("")) == [], storage.ls(Path(""))
    _saved_again(url)


_SAVE_WHILE_GC = r"""
import subprocess, sys, torch
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorage

url = sys.argv[1]
GC = (
    "import sys; from torch_checkpointing import FsspecStorageConfig; from torch_checkpointing.retention import "
    "collect_garbage as gc; r = gc(sys.argv[1], FsspecStorageConfig(url=sys.argv[1]).create_storage(), "
    "unowned_after_s=0); assert r.removed and not r.failed, r"
)

ran = []
made = FsspecStorage.mkdir

def mkdir_then_gc(self, path, recursive=True):
    # Right after the save makes (finds) the id's folder, before its claim: another process's gc collects the
    # dead save there, its claim and (now) the folder with it.
    made(self, path, recursive)
    if path.name == "step_1" and not ran:
        ran.append(path)
        subprocess.run([sys.executable, "-c", GC, url], check=True, timeout=120)

FsspecStorage.mkdir = mkdir_then_gc
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
with CheckpointManager(config) as manager:
    manager.save("step_1", {"model": {"w": torch.arange(5.0)}})
assert ran
"""


def test_a_save_whose_folder_gc_removed_before_its_claim_still_commits(tmp_path: Path) -> None:
    """The save found a killed save's claim at the id; gc collected it, folder and all, between the save's
    mkdir of the id and its claim. The claim's create makes the folder again (one level), as the mkdir did."""
    url = _root_url("file", tmp_path)
    _killed_save(url, "step_1", user={})
    done = subprocess.run(
        [sys.executable, "-c", _SAVE_WHILE_GC, url], cwd=REPO, env=_env(), capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    with _plain_manager(url) as manager:
        assert torch.equal(manager.load("step_1")["model"]["w"], torch.arange(5.0))
