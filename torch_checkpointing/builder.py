"""Factory functions for the savers, for code that wires the pieces without a CheckpointManager."""

from __future__ import annotations

from typing import Any

from torch_checkpointing.checkpoint_saver import AsyncCheckpointSaver, SyncCheckpointSaver
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig, check_instance
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.storage.base_storage import StorageConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

__all__ = ["make_async_checkpoint_saver", "make_sync_checkpoint_saver"]


def make_sync_checkpoint_saver(
    config: SyncCheckpointSaverConfig | None = None,
    storage_config: StorageConfig | None = None,
) -> SyncCheckpointSaver:
    config = SyncCheckpointSaverConfig() if config is None else config
    storage_config = LocalFileSystemStorageConfig() if storage_config is None else storage_config
    _check_arguments("make_sync_checkpoint_saver", config, SyncCheckpointSaverConfig, storage_config)
    return SyncCheckpointSaver(storage_config.create_storage(), config.writer_config)


def make_async_checkpoint_saver(
    config: AsyncCheckpointSaverConfig | None = None,
    subprocess_init_fn: Any = None,
    subprocess_init_args: tuple[Any, ...] = (),
    storage_config: StorageConfig | None = None,
) -> AsyncCheckpointSaver:
    config = AsyncCheckpointSaverConfig() if config is None else config
    storage_config = LocalFileSystemStorageConfig() if storage_config is None else storage_config
    _check_arguments("make_async_checkpoint_saver", config, AsyncCheckpointSaverConfig, storage_config)
    if subprocess_init_fn is not None and not callable(subprocess_init_fn):
        raise ConfigTypeError(
            f"make_async_checkpoint_saver(subprocess_init_fn=...) must be callable or None, got {subprocess_init_fn!r}."
        )
    if not isinstance(subprocess_init_args, tuple):
        raise ConfigTypeError(
            f"make_async_checkpoint_saver(subprocess_init_args=...) must be a tuple, got {subprocess_init_args!r}."
        )
    return AsyncCheckpointSaver(config, storage_config, subprocess_init_fn, subprocess_init_args)


def _check_arguments(function: str, config: object, kind: type, storage_config: object) -> None:
    """Checked here, where the saver is built: the async writer process would meet them first otherwise."""
    check_instance(function, "config", config, kind, f"Pass a {kind.__name__}, or None for the default.")
    fix = "Pass e.g. LocalFileSystemStorageConfig(), or None for the default."
    check_instance(function, "storage_config", storage_config, StorageConfig, fix)
