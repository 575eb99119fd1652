"""Round 25: `FsspecStorage.mkdir(recursive=False)` made every missing parent too (fsspec's makedirs), on the
filesystems where directories are real (`file://`, `memory://`).

The engine asks for one level (`Commit._mkdir_one`) so that a rank never re-creates the id's directories that
its save's rank 0 made and then removed (the save having failed there): a slower rank re-created them, wrote its
claim and files there, and left them, recorded nowhere. Now one level is made, and a missing parent is the
`CommitError` that names it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.checkpoint_writer import SavePlan, WriteEntry, WriteRequest, _write_local_files
from torch_checkpointing.commit import Commit
from torch_checkpointing.errors import CommitError
from torch_checkpointing.storage.fsspec_storage import FsspecStorage

pytest.importorskip("fsspec")


def _file_storage(tmp_path: Path) -> FsspecStorage:
    return FsspecStorageConfig(url=f"file://{tmp_path}").create_storage()


def _memory_storage(tmp_path: Path) -> FsspecStorage:
    return FsspecStorageConfig(url=f"memory://{tmp_path.name}", filesystem=MemoryFileSystem()).create_storage()


@pytest.mark.parametrize("make", [_file_storage, _memory_storage], ids=["file", "memory"])
def test_mkdir_of_one_level_makes_no_parent(tmp_path: Path, make: object) -> None:
    storage: FsspecStorage = make(tmp_path)  # type: ignore[operator]
    storage.mkdir(Path("."))  # the root (memory:// has none yet)
    with pytest.raises(FileNotFoundError):
        storage.mkdir(Path("a/b"), recursive=False)
    assert not storage.isdir(Path("a")) and not storage.isdir(Path("a/b"))
    storage.mkdir(Path("a"), recursive=False)
    storage.mkdir(Path("a/b"), recursive=False)
    storage.mkdir(Path("a/b"), recursive=False)  # there already: nothing to do
    assert storage.isdir(Path("a/b"))
    storage.mkdir(Path("c/d/e"))  # recursive, as before
    assert storage.isdir(Path("c/d/e"))


def test_a_rank_does_not_recreate_the_directories_rank_0_removed_on_a_file_url(tmp_path: Path) -> None:
    """Rank 1 of a save on `file://` through fsspec begins after its rank 0 failed and removed `runs/`, which it
    had made for the save."""
    storage = _file_storage(tmp_path)
    plan = SavePlan(checkpoint_dir="runs/step_1", tmp_dir="runs/.step_1.tmp-ab-1", rank=1, world_size=2)
    entry = WriteEntry("model", "rank_1/model.pt", TorchSerialization(), {"w": torch.ones(2)})
    with pytest.raises(CommitError, match=r"runs, which the save's rank 0 created or found"):
        _write_local_files(storage, WriteRequest(plan, [entry]), Commit(storage, plan.target()))
    assert os.listdir(tmp_path) == []
