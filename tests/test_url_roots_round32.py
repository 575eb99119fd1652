"""A URL root on a storage passed in that does not take URLs is refused naming it, as a manager refuses such an id.

Before, `latest_checkpoint("file:///abs/run", LocalFileSystemStorageConfig().create_storage())` looked for a
relative directory named `file:` and returned None (a resume from scratch) beside a committed checkpoint, where
the same call without a storage said "'file:///abs/run' is a file:// URL; pass the local path it names"; an
`s3://` root on the local storage listed nothing the same way, and retention deleted nothing, saying nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import (
    CheckpointManager,
    DTensorResharder,
    ItemSpec,
    latest_checkpoint,
    list_checkpoints,
    retention,
)
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import load_distributed_metadata
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


@pytest.fixture
def run(tmp_path: Path) -> Path:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2):
            manager.save(str(tmp_path / "run" / f"step_{step}"), {"m": {"x": torch.ones(2)}})
    return tmp_path / "run"


_CALLS = {
    "latest_checkpoint": lambda root, storage: latest_checkpoint(root, storage),
    "list_checkpoints": lambda root, storage: list_checkpoints(root, storage),
    "prune": lambda root, storage: retention.prune(root, RetentionPolicy(keep_last=1), storage=storage),
    "collect_garbage": lambda root, storage: retention.collect_garbage(root, storage),
    "delete_checkpoint": lambda root, storage: retention.delete_checkpoint(f"{root}/step_1", storage),
}


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_a_file_url_root_on_the_local_storage_names_its_path(run: Path, call: str) -> None:
    storage = LocalFileSystemStorageConfig().create_storage()
    with pytest.raises(ConfigError, match="pass the local path it names"):
        _CALLS[call](f"file://{run}", storage)
    assert [c.step for c in list_checkpoints(run)] == [1, 2]  # nothing deleted


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_an_object_store_url_root_on_the_local_storage_is_refused(run: Path, call: str) -> None:
    storage = LocalFileSystemStorageConfig().create_storage()
    with pytest.raises(ConfigError, match="s3://"):
        _CALLS[call]("s3://bucket/run", storage)


def test_load_distributed_metadata_refuses_a_file_url_on_the_local_storage(tmp_path: Path) -> None:
    """Before, `load_distributed_metadata("file:///abs/run/step_1", storage)` answered None, the answer for a
    checkpoint without resharded items, of one that holds metadata.json."""
    config = CheckpointManager.Config(
        items={"m": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
    )
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "step_1"), {"m": {"x": torch.ones(2)}})
    storage = LocalFileSystemStorageConfig().create_storage()
    assert load_distributed_metadata(tmp_path / "step_1", storage) is not None
    with pytest.raises(ConfigError, match="pass the local path it names"):
        load_distributed_metadata(f"file://{tmp_path}/step_1", storage)
