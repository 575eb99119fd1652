"""A failed save's own cleanup never deletes a file it cannot tell apart from its own.

A save whose claim says its uploads are tagged (`"tags": true`: the store said it records the writer of each
object) removes, when it fails, only what the store lists as written by saves of ours. Where the store then lists
no such record (`objects_by_save` None), the cleanup deleted every object under the id but the marker: a user's
`notes.txt` put there while the save ran went with it. No store this package ships answers that way (S3 tags and
lists; the others do not tag), so the store here is `FsspecStorage` on `file://` told to say it tags.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorage

pytest.importorskip("fsspec")


class _TagsButListsNone(FsspecStorage):
    """Says every upload names its save (a store's promise), and lists no such record (`objects_by_save` None)."""

    def own_writes(self, root: Path, token: str) -> bool:
        super().own_writes(root, token)
        return True


class _TagsButListsNoneConfig(FsspecStorageConfig):
    def create_storage(self) -> FsspecStorage:
        return _TagsButListsNone(self)


def test_a_failed_save_keeps_a_users_file_where_the_store_lists_no_tags(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: notes.txt, put under the id while the save ran, was deleted by the save's cleanup."""
    url = f"file://{tmp_path}/run"
    notes = tmp_path / "run" / "step_1" / "notes.txt"

    def user_writes_then_check_fails(_checkpoint_id: str, _: Any) -> None:
        notes.write_text("mine")
        raise RuntimeError("the pre-commit check failed")

    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=_TagsButListsNoneConfig(url=url))
    config.pre_finalize_callback = user_writes_then_check_fails
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with CheckpointManager(config) as manager, pytest.raises(RuntimeError, match="pre-commit check"):
        manager.save("step_1", {"model": {"w": torch.arange(4.0)}})
    assert notes.read_text() == "mine"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("notes.txt" in message and "by hand" in message for message in warned), warned
