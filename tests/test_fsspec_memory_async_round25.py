"""Round 25: an async save to `memory://` failed with a CommitError about another rank's disk.

`memory://` lives in the memory of one process, and an async save writes from its writer process, whose
`memory://` is another, empty one. Before the one-level mkdir of 95fe50a the writer re-created the id's
directories in its own memory and "committed" there: save() succeeded and the load of that id found nothing
(a silent loss). Since, the writer's mkdir found no parent and the save failed with "... which the save's rank 0
created or found for it, is not there on this rank ... not a node-local disk": the wrong cause and the wrong
fix. It is now a ConfigError at save(), naming memory:// and what to use instead, before anything is written.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

fsspec = pytest.importorskip("fsspec")


def _manager(saver: AsyncCheckpointSaverConfig | SyncCheckpointSaverConfig, url: str = "") -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=saver, storage_config=FsspecStorageConfig(url=url)))


@pytest.mark.parametrize("where", ["root", "full id"])
def test_an_async_save_to_memory_is_refused_naming_memory_and_the_fix(where: str) -> None:
    bucket = f"memory://{uuid.uuid4().hex}"
    url, checkpoint_id = (f"{bucket}/runs", "a/step_1") if where == "root" else ("", f"{bucket}/runs/a/step_1")
    with _manager(AsyncCheckpointSaverConfig(), url) as manager:
        with pytest.raises(ConfigError, match=r"memory://") as refused:
            manager.save(checkpoint_id, {"w": torch.ones(3)})
        assert "SyncCheckpointSaverConfig" in str(refused.value), refused.value
        assert "writer process" in str(refused.value), refused.value
    assert not fsspec.filesystem("memory").exists(f"{bucket}/runs/a/step_1")  # nothing of it was written
    with _manager(SyncCheckpointSaverConfig(), url) as manager:  # and a sync save there works
        manager.save(checkpoint_id, {"w": torch.ones(3)})
        assert torch.equal(manager.load(checkpoint_id)["w"], torch.ones(3))
