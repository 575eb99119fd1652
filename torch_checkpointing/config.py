"""Saver and loader configuration dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
from torch_checkpointing.staging import CheckpointStagerConfig

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_SECS",
    "AsyncCheckpointSaverConfig",
    "CheckpointLoaderConfig",
    "CheckpointSaverConfig",
    "SyncCheckpointSaverConfig",
]

DEFAULT_WAIT_TIMEOUT_SECS = 600


@dataclass(kw_only=True)
class CheckpointSaverConfig:
    """Settings shared by both savers; pick `SyncCheckpointSaverConfig` or `AsyncCheckpointSaverConfig`."""

    writer_config: CheckpointWriterConfig = field(default_factory=CheckpointWriterConfig)
    # How long save()/close() wait on a previous write, and multi-rank commits wait on other ranks.
    wait_timeout_secs: int | None = DEFAULT_WAIT_TIMEOUT_SECS
    # Whether a save may replace an existing checkpoint of ours at its id (atomically; the old one stays intact
    # until the new one is durable). A path that is not a checkpoint of ours is never replaced, whatever this says.
    overwrite: bool = True

    def __post_init__(self) -> None:
        if self.wait_timeout_secs is not None and self.wait_timeout_secs < 0:
            raise ValueError("wait_timeout_secs must be non-negative or None")


@dataclass(kw_only=True)
class SyncCheckpointSaverConfig(CheckpointSaverConfig):
    """Write inline: `save()` returns once the checkpoint is committed and durable."""


@dataclass
class AsyncCheckpointSaverConfig(CheckpointSaverConfig):
    """Stage off the training thread, write from a background process; `save()` returns a Future."""

    staging_config: CheckpointStagerConfig = field(default_factory=CheckpointStagerConfig)
    process_config: CheckpointProcessConfig = field(default_factory=CheckpointProcessConfig)


@dataclass(kw_only=True)
class CheckpointLoaderConfig:
    """How `CheckpointManager.load` reads files: mmap, torch's safe unpickler, checksum verification."""

    use_mmap: bool = True
    # torch's safe unpickler for TorchSerialization files; set False only for checkpoints you trust.
    weights_only: bool = True
    # CRC32 of every file a load reads, against the manifest. None (default): verify whatever the manifest
    # records; True: the same, and refuse a directory without a manifest; False: sizes only (know why).
    verify_checksums: bool | None = None
    # Directories without a manifest (the published release wrote none) load unverified with a logged warning;
    # False refuses them.
    allow_legacy_checkpoints: bool = True
