"""The non-exchange replace (`Storage.replace_directory`'s fallback) when putting the old checkpoint back fails.

Real renames on a real filesystem: another process puts a regular file at the checkpoint's id in the moment
between the two renames, so the new checkpoint cannot move in and the old one cannot move back (ENOTDIR both).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig


class _FileAtTheId(LocalFileSystemStorage):
    """Real renames; just before the new checkpoint moves in, a regular file takes the id (another process)."""

    def __init__(self, new: Path) -> None:
        super().__init__(LocalFileSystemStorageConfig(use_direct_io=False))
        self._new = new

    def rename(self, src_path: Path, dst_path: Path, is_directory: bool = False, **kwargs: bool) -> None:
        if Path(src_path) == self._new:
            Path(dst_path).write_bytes(b"not a checkpoint")
        super().rename(src_path, dst_path, is_directory, **kwargs)


def test_a_failed_put_back_is_a_warning_naming_both_paths_and_the_swaps_error_is_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the put-back's own ENOTDIR replaced the swap's error and nothing said where the old checkpoint
    went (it sat, intact, under a hidden `.old_` name)."""
    dst, new = tmp_path / "step_1", tmp_path / ".tmp-step_1"
    dst.mkdir()
    (dst / "f").write_bytes(b"old")
    new.mkdir()
    (new / "f").write_bytes(b"new")
    storage = _FileAtTheId(new)
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with pytest.raises(NotADirectoryError) as raised:
        Storage.replace_directory(storage, new, dst)  # the base-class fallback (no atomic exchange)
    assert raised.value.filename == os.fspath(new)  # the swap's error, not the put-back's
    (aside,) = [p for p in tmp_path.iterdir() if p not in (dst, new)]
    assert (aside / "f").read_bytes() == b"old"  # the old checkpoint is intact beside its id
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    message = warnings[0].getMessage()
    assert os.fspath(dst) in message and os.fspath(aside) in message and "rename" in message
    assert warnings[0].name.startswith("torch_checkpointing")


def test_a_put_back_that_works_logs_nothing_and_the_old_checkpoint_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dst = tmp_path / "step_1"
    dst.mkdir()
    (dst / "f").write_bytes(b"old")
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=False))
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with pytest.raises(FileNotFoundError):
        Storage.replace_directory(storage, tmp_path / "missing", dst)
    assert (dst / "f").read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["step_1"]
    assert not caplog.records
