"""The engine's public API, imported in one place so a missing or broken engine
shows up as one clear error per section instead of an ImportError traceback."""

from __future__ import annotations

from typing import Any

from .config import BenchConfig


def make_manager(
    cfg: BenchConfig,
    items: dict[str, Any] | None = None,
    sync_save: bool = False,
    overlap_staging: bool = False,
    verify_checksums: bool | None = None,
    collective: bool = True,
) -> Any:
    """An async-save CheckpointManager on local storage with the configured direct-I/O choice.

    `overlap_staging` moves the staging copy off save() (CheckpointStagerConfig(use_async_staging=True)), the mode
    for loops that put their in-place updates inside lock(); by default save() returns once the copy is done.
    `verify_checksums` is the loader's setting (None: the default, verifying); `collective=False` lets one rank
    load while the others do not (CheckpointLoaderConfig.collective).
    """
    from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    conf = CheckpointManager.Config.with_sync_save() if sync_save else CheckpointManager.Config.with_async_save()
    if overlap_staging:
        if not isinstance(conf.save, AsyncCheckpointSaverConfig):
            raise ValueError(
                "make_manager(overlap_staging=True, sync_save=True): a sync save has no staging copy to move off "
                "save(); pass sync_save=False to overlap the staging"
            )
        conf.save.staging_config.use_async_staging = True
    conf.storage_config = LocalFileSystemStorageConfig(use_direct_io=cfg.direct_io)
    if items:
        conf.items = items
    conf.load.verify_checksums = verify_checksums
    conf.load.collective = collective
    return CheckpointManager(conf)


def import_engine() -> None:
    """Import the engine up front, so that a timed construction measures the constructor, not the import.

    The package's public names load their modules on first access (lazy exports), so naming the package is not
    enough: `CheckpointManager` itself is fetched here, as a script's `from torch_checkpointing import ...` does.
    """
    import torch_checkpointing
    import torch_checkpointing.storage.filesystem

    assert torch_checkpointing.CheckpointManager is not None


def no_copy_items(keys: list[str]) -> dict[str, Any]:
    from torch_checkpointing import ItemSpec

    return {k: ItemSpec(requires_copy=False) for k in keys}
