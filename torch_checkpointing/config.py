"""Every configuration dataclass of the savers and the loader, in one module.

One module so that building a configuration (in a launcher, a config system, a test) imports neither torch
nor the writer-process stack. `CheckpointStagerConfig`, `CheckpointWriterConfig` and `CheckpointProcessConfig`
are also importable from `staging`, `checkpoint_writer` and `checkpoint_process`, where they used to live.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # barriers imports torch.distributed; the type is needed for annotations only
    from torch_checkpointing.barriers import BarrierConfig

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_SECS",
    "AsyncCheckpointSaverConfig",
    "CheckpointLoaderConfig",
    "CheckpointProcessConfig",
    "CheckpointSaverConfig",
    "CheckpointStagerConfig",
    "CheckpointWriterConfig",
    "SyncCheckpointSaverConfig",
]

DEFAULT_WAIT_TIMEOUT_SECS = 600
_DEFAULT_METRIC_PREFIX = "train.checkpoint_write"
_DEFAULT_BARRIER_TIMEOUT_SECS = 600


def _warn_ignored(field_name: str, why: str) -> None:
    """A field kept for configs written against the published release, which the engine does not read."""
    warnings.warn(f"{field_name} is ignored and will be removed: {why}", FutureWarning, stacklevel=4)


def _cuda_available() -> bool:
    """Imports torch only when a default is actually computed (constructing the config), not on import."""
    import torch

    return torch.cuda.is_available()


@dataclass
class CheckpointStagerConfig:
    """How `requires_copy=True` values are copied before an async write: memory kind and scheduling."""

    use_pinned_memory: bool = field(default_factory=_cuda_available)
    use_shared_memory: bool = True
    # False: save() returns once the copy is done, so the loop may mutate right away (the design document's
    # promise for requires_copy=True). True: the copy overlaps the caller's next work, and in-place updates
    # must then go inside CheckpointManager.lock(), which waits for the copy.
    use_async_staging: bool = False
    use_non_blocking_copy: bool = field(default_factory=_cuda_available)
    thread_name: str = "ckpt-staging"
    metric_prefix: str = _DEFAULT_METRIC_PREFIX  # ignored (the engine reports no metrics); warns when set
    # Where the shared staging slab lives (with use_shared_memory). None: anonymous shared memory (memfd),
    # which a small /dev/shm (64 MiB in containers) does not limit. A directory: an unlinked file there,
    # mapped shared; it must have room for the whole staged state (about the size of the payload's tensors).
    staging_dir: str | None = None

    def __post_init__(self) -> None:
        if self.metric_prefix != _DEFAULT_METRIC_PREFIX:
            _warn_ignored("CheckpointStagerConfig.metric_prefix", "the engine reports no metrics; leave it unset.")


@dataclass
class CheckpointWriterConfig:
    """The writer: barrier timeout and barrier between ranks, and how many threads write files."""

    # Both ignored, and warn when set: the ranks of a save always commit together through the agreement
    # over rank 0's TCPStore, bounded by CheckpointSaverConfig.wait_timeout_secs.
    checkpoint_write_barrier_timeout_sec: int = _DEFAULT_BARRIER_TIMEOUT_SECS
    barrier_config: BarrierConfig | None = None
    file_write_max_threads: int = 1

    def __post_init__(self) -> None:
        if self.file_write_max_threads < 1:
            raise ValueError("file_write_max_threads must be positive")
        how = "multi-rank saves always commit together, bounded by CheckpointSaverConfig.wait_timeout_secs."
        if self.barrier_config is not None:
            _warn_ignored("CheckpointWriterConfig.barrier_config", how)
        if self.checkpoint_write_barrier_timeout_sec != _DEFAULT_BARRIER_TIMEOUT_SECS:
            _warn_ignored("CheckpointWriterConfig.checkpoint_write_barrier_timeout_sec", f"{how} Set that instead.")


@dataclass
class CheckpointProcessConfig:
    """The background writer process of async saves: start and shutdown timeouts, thread names."""

    # Spawning imports torch in a fresh interpreter: seconds, more on a loaded 2-core machine with many ranks.
    subprocess_init_timeout_secs: int = 300
    subprocess_shutdown_timeout_secs: int = 60
    thread_name_prefix: str = "ckpt"


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
    # On several ranks a load is collective: the ranks agree after checking, so it goes on on every rank or on
    # none, and a load on some ranks only waits for the others (until save.wait_timeout_secs). False: each rank
    # loads on its own (a rank-0-only read, an evaluation process), and one rank's failure is its own.
    collective: bool = True
