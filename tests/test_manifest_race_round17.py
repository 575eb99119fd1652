"""A manifest that goes between its existence check and its read (round 17).

On an object store a load without templates reads the manifest through `read_manifest`: a HEAD that finds it,
then a ranged GET. A delete-and-resave of the id landing between the two raised s3fs' bare FileNotFoundError
"The specified key does not exist.", naming neither the checkpoint nor what to do (seen in the racing load of
tests/test_s3_attack_round16.py, about one run in five on a loaded machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.memory_storage import MemoryStorage, MemoryStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.manifest import MANIFEST_FILE_NAME, read_manifest


class _DeletedAfterFound(MemoryStorage):
    """The manifest is deleted right after a lookup finds it: another process's delete landing in between."""

    def exists(self, path: Path) -> bool:
        found = super().exists(path)
        if found and str(path).endswith(MANIFEST_FILE_NAME):
            self.delete(path)
        return found


def test_a_manifest_deleted_between_its_lookup_and_its_read_is_a_checkpoint_error_naming_the_id() -> None:
    config = MemoryStorageConfig()
    manager = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config).build()
    try:
        manager.save("/run/x", {"model": {"w": torch.ones(2)}})
    finally:
        manager.close()
    racing = _DeletedAfterFound(config.store)
    with pytest.raises(CheckpointError, match=r"/run/x") as info:
        read_manifest(racing, Path("/run/x"))
    assert "retry" in str(info.value).lower(), str(info.value)
