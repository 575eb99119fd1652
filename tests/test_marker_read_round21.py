"""An `.incomplete` file larger than any marker of ours (another program's: a download tool's progress) is
refused before a byte of it is read, on a local disk as on an object store.

Before, on a local disk it was read whole (up to the 256 MiB a manifest may have) and only then found too
large: gc and ls, which look at every leftover's marker, took a foreign file's size in memory each time.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.manifest import MAX_MARKER_BYTES, read_marker
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

FOREIGN_BYTES = 64 << 20  # sparse: no disk taken, but 64 MiB to read


def _foreign_marker(root: Path) -> Path:
    folder = root / ".ck.tmp-0123456789ab-1"  # named like a temporary of ours
    folder.mkdir(parents=True)
    with open(folder / ".incomplete", "wb") as f:
        f.truncate(FOREIGN_BYTES)
    return folder / ".incomplete"


def test_a_large_foreign_marker_is_refused_unread_on_a_local_disk(tmp_path: Path) -> None:
    marker = _foreign_marker(tmp_path / "run")
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=rf"larger than {MAX_MARKER_BYTES}.*\.incomplete marker"):
            read_marker(storage, marker)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_MARKER_BYTES * 4, f"read {peak} bytes of a {FOREIGN_BYTES}-byte file"  # before: 64 MiB


def test_gc_keeps_a_folder_whose_large_incomplete_is_not_ours(tmp_path: Path) -> None:
    marker = _foreign_marker(tmp_path / "run")
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
    report = collect_garbage(str(tmp_path / "run"), storage, unowned_after_s=0)
    assert not report.removed and not report.failed, report
    assert marker.stat().st_size == FOREIGN_BYTES
