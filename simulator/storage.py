"""A storage that wraps the backend's storage (local filesystem, or fsspec for --storage-url) to count reads and
slow down writes.

Slowing writes keeps an async write in flight long enough for the training loop
to race it; counting reads gives the report its "bytes read" column. The config
is a plain dataclass at module level, so the backend can pickle it into its
spawned writer process, which re-imports this module (and finds the backend
through ``SIMULATOR_BACKEND``).

With ``url`` set (``--storage-url``), the wrapped storage is the backend's public ``FsspecStorageConfig(url=...)``:
credentials and an S3-compatible endpoint come from the environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``...), which ranks and writer processes inherit, so the config carries no secret.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from simulator.backend import backend_module

_base = backend_module("storage.base_storage")
_fs = backend_module("storage.filesystem")

_COUNTERS = {"bytes_read": 0}


def bytes_read() -> int:
    """Bytes read through any InstrumentedStorage in this process so far."""
    return _COUNTERS["bytes_read"]


def fsspec_storage_config(url: str) -> Any:
    """The backend's public ``FsspecStorageConfig`` for ``url`` (its endpoint and credentials from the environment)."""
    top = backend_module()
    config_cls = getattr(top, "FsspecStorageConfig", None)
    if config_cls is None:
        raise ImportError(
            f"backend {top.__name__!r} exports no FsspecStorageConfig, which --storage-url {url!r} needs; "
            "run without --storage-url to use the local filesystem"
        )
    return config_cls(url=url)


class _BackendStorage(Protocol):
    """The storage methods of the design document that the wrapper forwards to the backend's storage (whose class
    is the backend's, picked at run time)."""

    def handles_url(self, checkpoint_id: str) -> bool: ...
    def read(self, path: Path, read_args: Any = None) -> bytes: ...
    def stream_write(self, path: Path) -> io.IOBase: ...
    def write(self, path: Path, data: Any) -> None: ...
    def delete(self, path: Path) -> None: ...
    def mkdir(self, path: Path, recursive: bool = True) -> None: ...
    def rmdir(self, path: Path) -> None: ...
    def rename(
        self, src_path: Path, dst_path: Path, is_directory: bool, is_cross_link: bool, background_cleanup: bool
    ) -> None: ...
    def ls(self, path: Path) -> list[str]: ...
    def exists(self, path: Path) -> bool: ...
    def getsize(self, path: Path) -> int: ...
    def isdir(self, path: Path) -> bool: ...
    def remap_path(self, path: Path) -> str: ...


@dataclass
class InstrumentedStorageConfig(_base.StorageConfig):  # type: ignore[misc, name-defined]
    """Buffered local storage (no O_DIRECT), or the fsspec store at ``url``; sleeps ``write_delay_s`` per write."""

    write_delay_s: float = 0.0
    url: str = ""

    def create_storage(self) -> InstrumentedStorage:
        return InstrumentedStorage(self)


class InstrumentedStorage(_base.Storage):  # type: ignore[misc, name-defined]
    def __init__(self, config: InstrumentedStorageConfig) -> None:
        self._inner: _BackendStorage = (
            fsspec_storage_config(config.url).create_storage()
            if config.url
            else _fs.LocalFileSystemStorage(_fs.LocalFileSystemStorageConfig(use_direct_io=False))
        )
        self._delay = config.write_delay_s
        # An object store commits with a commit file instead of a rename; the engine must see that.
        self.atomic_rename = getattr(self._inner, "atomic_rename", True)
        for optional in ("sync_directory", "replace_directory"):
            if hasattr(self._inner, optional):
                setattr(self, optional, getattr(self._inner, optional))

    def handles_url(self, checkpoint_id: str) -> bool:
        return bool(self._inner.handles_url(checkpoint_id))

    def _sleep(self) -> None:
        if self._delay > 0:
            time.sleep(self._delay)

    def stream_read(self, path: Path, read_args: Any = None) -> io.RawIOBase:
        data = self._inner.read(path, read_args)
        _COUNTERS["bytes_read"] += len(data)
        return io.BytesIO(data)  # type: ignore[return-value]

    def read(self, path: Path, read_args: Any = None) -> bytes:
        data = self._inner.read(path, read_args)
        _COUNTERS["bytes_read"] += len(data)
        return data

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        data: bytes
        if hasattr(self._inner, "read_range"):
            data = self._inner.read_range(path, offset, length)
        else:
            data = self._inner.read(path)[offset : offset + length]
        _COUNTERS["bytes_read"] += len(data)
        return data

    def stream_write(self, path: Path) -> io.IOBase:
        self._sleep()
        return self._inner.stream_write(path)

    def write(self, path: Path, data: Any) -> None:
        self._sleep()
        self._inner.write(path, data)

    def delete(self, path: Path) -> None:
        self._inner.delete(path)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        self._inner.mkdir(path, recursive)

    def rmdir(self, path: Path) -> None:
        self._inner.rmdir(path)

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        is_cross_link: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        self._inner.rename(src_path, dst_path, is_directory, is_cross_link, background_cleanup)

    def ls(self, path: Path) -> list[str]:
        return self._inner.ls(path)

    def exists(self, path: Path) -> bool:
        return self._inner.exists(path)

    def getsize(self, path: Path) -> int:
        return self._inner.getsize(path)

    def isdir(self, path: Path) -> bool:
        return self._inner.isdir(path)

    def remap_path(self, path: Path) -> str:
        return self._inner.remap_path(path)
