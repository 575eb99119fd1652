"""Engine files (a manifest, an `.incomplete` marker) are read bounded: what is read is what the file holds,
and a file larger than its kind's limit is refused before a byte of it is read.

Before: every local manifest read allocated its limit, 256 MiB, whatever the manifest's size (`read(limit + 1)`
allocates its argument up front), and the `.incomplete` found beside a manifest that names a save's claim
(`manifest._stray_marker`) was read with that limit, not the marker's.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError, IncompleteCheckpointError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME, MAX_MARKER_BYTES, read_manifest
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

SMALL_PEAK_BYTES = 4 << 20  # a few MiB: far below the 64 MiB marker and the 256 MiB limit these tests would see
BIG_MARKER_BYTES = 64 << 20  # sparse: no disk taken, but 64 MiB to read


class _NoLocalPaths(LocalFileSystemStorage):
    """A local disk read as an object store is: by size and ranges, never by a local path."""

    def local_path(self, path: Path) -> str | None:
        return None


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


def _claimed_checkpoint(root: Path, marker_bytes: int) -> Path:
    """A committed checkpoint whose manifest names a save's claim, beside a sparse `.incomplete` of that size."""
    path = _checkpoint(root)
    doc = json.loads((path / MANIFEST_FILE_NAME).read_text())
    (path / MANIFEST_FILE_NAME).write_text(json.dumps({**doc, "claim": "token-of-the-committing-save"}))
    with open(path / INCOMPLETE_MARKER, "wb") as f:
        f.truncate(marker_bytes)
    return path


@pytest.mark.parametrize("storage_type", [LocalFileSystemStorage, _NoLocalPaths], ids=["local", "no-local-path"])
def test_a_marker_past_the_marker_limit_beside_a_claimed_manifest_is_refused_unread(
    tmp_path: Path, storage_type: type[LocalFileSystemStorage]
) -> None:
    """Failed before: IncompleteCheckpointError, after reading the 64 MiB marker whole."""
    path = _claimed_checkpoint(tmp_path, BIG_MARKER_BYTES)
    storage: Storage = storage_type(LocalFileSystemStorageConfig(use_direct_io=False))
    refused: list[CorruptCheckpointError] = []

    def read() -> None:
        with pytest.raises(CorruptCheckpointError) as caught:
            read_manifest(storage, path)
        refused.append(caught.value)

    peak = _peak_of(read)
    message = str(refused[0])
    assert str(path / INCOMPLETE_MARKER) in message and str(MAX_MARKER_BYTES) in message, message
    assert "remove it" in message, message  # says what to do
    assert peak < SMALL_PEAK_BYTES, f"read {peak} bytes of a {BIG_MARKER_BYTES}-byte marker"


def test_a_small_marker_beside_a_claimed_manifest_is_still_judged_by_its_claim(tmp_path: Path) -> None:
    """Unchanged: an empty marker (an unfinished commit or delete) still makes the checkpoint incomplete."""
    path = _claimed_checkpoint(tmp_path, 0)
    with pytest.raises(IncompleteCheckpointError):
        read_manifest(LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=False)), path)
