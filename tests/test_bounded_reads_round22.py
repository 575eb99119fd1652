"""Engine files (a manifest, an `.incomplete` marker) are read bounded: what is read is what the file holds,
and a file larger than its kind's limit is refused before a byte of it is read.

Before: every local manifest read allocated its limit, 256 MiB, whatever the manifest's size (`read(limit + 1)`
allocates its argument up front), and the `.incomplete` found beside a manifest that names a save's claim
(`manifest._stray_marker`) was read with that limit, not the marker's.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.manifest import MANIFEST_FILE_NAME, read_manifest
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

SMALL_PEAK_BYTES = 4 << 20  # a few MiB: far below the 64 MiB marker and the 256 MiB limit these tests would see


def _checkpoint(root: Path) -> Path:
    path = root / "step_1"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(path), {"model": {"w": torch.zeros(4)}}, step=1)
    return path


def _peak_of(read: object) -> int:
    tracemalloc.start()
    try:
        read()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_manifest_read_allocates_what_the_manifest_holds_not_its_limit(tmp_path: Path) -> None:
    """Failed before: 268 MB traced for a manifest of about 1 KiB."""
    path = _checkpoint(tmp_path)
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=False))
    peak = _peak_of(lambda: read_manifest(storage, path))
    assert peak < SMALL_PEAK_BYTES, f"reading a {(path / MANIFEST_FILE_NAME).stat().st_size}-byte manifest took {peak}"
