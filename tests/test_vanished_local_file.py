"""A local engine file (a manifest, a marker, a save's record) that is not there reads as not there, as on a store.

`manifest.read_local_regular` turned the open's ENOENT into a `CorruptCheckpointError` ("Cannot open ...: [Errno
2]"): damage, for a file a deletion or a replace in another process took since it was found. Every reader written
for stores catches `FileNotFoundError` for that case; on a local disk it never came, so each caller had to look at
the error's cause (and one that did not, gc's read of a save's record, warned that the record "is not one of ours").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.manifest import read_bounded, read_marker
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def _local(tmp_path: Path) -> tuple[Storage, Path]:
    return LocalFileSystemStorage(LocalFileSystemStorageConfig()), tmp_path / "ck"


def _memory(tmp_path: Path) -> tuple[Storage, Path]:
    storage = FsspecStorageConfig(url=f"memory://{tmp_path.name}", filesystem=MemoryFileSystem()).create_storage()
    storage.mkdir(Path("ck"))
    return storage, Path("ck")


@pytest.mark.parametrize("where", [_local, _memory], ids=["local", "memory"])
@pytest.mark.parametrize("read", [read_bounded, read_marker], ids=["manifest", "marker"])
def test_a_file_not_there_is_file_not_found_on_every_store(tmp_path: Path, where: object, read: object) -> None:
    """Defect (local only): CorruptCheckpointError "Cannot open .../ck/manifest.json: [Errno 2] No such file or
    directory"; a memory:// store said FileNotFoundError."""
    storage, root = where(tmp_path)  # type: ignore[operator]
    (tmp_path / "ck").mkdir(exist_ok=True)
    with pytest.raises(FileNotFoundError) as caught:
        read(storage, root / "manifest.json")  # type: ignore[operator]
    assert not isinstance(caught.value, CorruptCheckpointError)
    assert "manifest.json" in str(caught.value)
