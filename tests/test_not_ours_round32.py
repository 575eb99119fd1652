"""What only looks like ours is never replaced (round 32).

docs/durability.md: "Nothing that is not ours is ever replaced ... Anything else is refused with a CommitError".
An id holding nothing but an `.incomplete` was taken as a failed save of ours by its name alone: a symbolic link
of that name (we write none) was removed by the next save, and so was another program's non-empty `.incomplete`
(a download's progress; ours is empty). And a checkpoint with an empty folder someone added inside it was
replaced, the folder deleted with it, though the manifest lists no such folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec, list_checkpoints
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.commit import files_not_listed
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CommitError
from torch_checkpointing.retention import delete_checkpoint
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig


def _save(path: Path) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(path), {"m": {"w": torch.ones(2)}})


def test_an_incomplete_that_is_a_symlink_is_not_ours(tmp_path: Path) -> None:
    """Defect: the save committed over it, removing the link (its target stayed)."""
    target = tmp_path / "progress"
    target.write_text("42%")
    (tmp_path / "ck").mkdir()
    os.symlink(target, tmp_path / "ck" / ".incomplete")
    with pytest.raises(CommitError, match=r"not a checkpoint.*\.incomplete"):
        _save(tmp_path / "ck")
    assert os.readlink(tmp_path / "ck" / ".incomplete") == os.fspath(target)
    assert target.read_text() == "42%"


def test_another_programs_incomplete_alone_is_not_ours(tmp_path: Path) -> None:
    """Defect: a lone non-empty `.incomplete` (ours is always empty where saves rename) was deleted by the save."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".incomplete").write_text("resume at byte 4096")
    with pytest.raises(CommitError, match=r"not a checkpoint.*\.incomplete"):
        _save(tmp_path / "ck")
    assert (tmp_path / "ck" / ".incomplete").read_text() == "resume at byte 4096"


def test_our_empty_marker_alone_is_still_taken_over(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".incomplete").write_bytes(b"")
    _save(tmp_path / "ck")
    assert [info.path for info in list_checkpoints(tmp_path)] == [str(tmp_path / "ck")]


def test_a_checkpoint_with_an_empty_folder_added_is_not_replaced_or_deleted(tmp_path: Path) -> None:
    """Defect: the replace committed and the folder was gone; so did a delete."""
    _save(tmp_path / "ck")
    (tmp_path / "ck" / "notes" / "empty").mkdir(parents=True)
    with pytest.raises(CommitError, match=r"not part of it.*notes/"):
        _save(tmp_path / "ck")
    assert delete_checkpoint(tmp_path / "ck") is False  # refused, with a WARNING naming what is there
    assert (tmp_path / "ck" / "notes" / "empty").is_dir()
    (tmp_path / "ck" / "notes" / "empty").rmdir()
    (tmp_path / "ck" / "notes").rmdir()
    _save(tmp_path / "ck")  # without it, replaced as before


def test_an_emptied_folder_of_a_listed_file_is_still_the_checkpoints(tmp_path: Path) -> None:
    """What a removal killed midway leaves (the manifest goes last): deletable, not someone else's folder."""
    items = {"m": ItemSpec(layout=LayoutInfo("sub/deep/m_{rank}.pt", TorchSerialization()))}
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), items=items)) as manager:
        manager.save(str(tmp_path / "ck"), {"m": {"w": torch.ones(2)}})
    (tmp_path / "ck" / "sub" / "deep" / "m_0.pt").unlink()
    assert files_not_listed(LocalFileSystemStorage(LocalFileSystemStorageConfig()), tmp_path / "ck") == []
    (tmp_path / "ck" / "sub" / "other").mkdir()
    assert files_not_listed(LocalFileSystemStorage(LocalFileSystemStorageConfig()), tmp_path / "ck") == ["sub/other/"]
