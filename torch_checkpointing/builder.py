"""Factory functions for the savers, for code that wires the pieces without a CheckpointManager."""

from __future__ import annotations

from typing import Any

from torch_checkpointing.checkpoint_saver import AsyncCheckpointSaver, SyncCheckpointSaver
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage.base_storage import StorageConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

__all__ = ["make_async_checkpoint_saver", "make_sync_checkpoint_saver"]


def make_sync_checkpoint_saver(
    config: SyncCheckpointSaverConfig | None = None,
    storage_config: StorageConfig | None = None,
) -> SyncCheckpointSaver:
    config = config or SyncCheckpointSaverConfig()
    storage = (storage_config or LocalFileSystemStorageConfig()).create_storage()
    return SyncCheckpointSaver(storage, config.writer_config)


def make_async_checkpoint_saver(
    config: AsyncCheckpointSaverConfig | None = None,
    subprocess_init_fn: Any = None,
    subprocess_init_args: tuple[Any, ...] = (),
    storage_config: StorageConfig | None = None,
) -> AsyncCheckpointSaver:
    return AsyncCheckpointSaver(
        config or AsyncCheckpointSaverConfig(),
        storage_config or LocalFileSystemStorageConfig(),
        subprocess_init_fn,
        subprocess_init_args,
    )
