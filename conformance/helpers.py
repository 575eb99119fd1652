"""Small helpers shared by the conformance tests (public API of the backend only).

Storage configuration is not part of the design document; unless a test is about
the defaults, managers are built with buffered (non O_DIRECT) local storage so that
the clauses run on any local filesystem (see CLAUSES.md, "Reading of storage").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

from conformance import backend

SaveMode = Literal["sync", "async"]
WRITE_TIMEOUT_S = 120.0
_UNSET: Any = object()


def buffered_storage() -> Any:
    """LocalFileSystemStorageConfig(use_direct_io=False) from the backend."""
    cfg = backend.name("storage.filesystem", "LocalFileSystemStorageConfig")
    return cfg(use_direct_io=False)


def make_config(
    items: Mapping[str, Any] | None = None,
    default: Any = _UNSET,
    *,
    mode: SaveMode = "sync",
    buffered: bool = True,
) -> Any:
    """Build CheckpointManager.Config the way user code does, plus save mode and storage."""
    manager_cls = backend.name("", "CheckpointManager")
    kwargs: dict[str, Any] = {"items": dict(items or {})}
    if default is not _UNSET:
        kwargs["default"] = default
    saver = "SyncCheckpointSaverConfig" if mode == "sync" else "AsyncCheckpointSaverConfig"
    kwargs["save"] = backend.name("config", saver)()
    if buffered:
        kwargs["storage_config"] = buffered_storage()
    return manager_cls.Config(**kwargs)


def save(manager: Any, path: Path | str, payload: Mapping[str, Any], timeout: float = WRITE_TIMEOUT_S) -> None:
    """Save and wait until durable, whatever the save mode returns."""
    result = manager.save(str(path), payload)
    if isinstance(result, Future):
        result.result(timeout=timeout)


def files(root: Path | str) -> set[str]:
    """All regular files under ``root`` as POSIX paths relative to it."""
    root = Path(root)
    out: set[str] = set()
    for dirpath, _dirs, names in os.walk(root):
        for fname in names:
            out.add((Path(dirpath) / fname).relative_to(root).as_posix())
    return out


def layout(path: str, fmt: str, *args: Any, **kwargs: Any) -> Any:
    """LayoutInfo(path, <Format>(*args, **kwargs)) from checkpoint_layout."""
    fmt_cls = backend.name("checkpoint_layout", fmt)
    return backend.name("checkpoint_layout", "LayoutInfo")(path, fmt_cls(*args, **kwargs))


def spec(**kwargs: Any) -> Any:
    """ItemSpec(**kwargs) from the package top level."""
    return backend.name("", "ItemSpec")(**kwargs)
