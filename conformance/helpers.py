"""Small helpers shared by the conformance tests (public API of the backend only).

Storage configuration is not part of the design document; unless a test is about
the defaults, managers are built with buffered (non O_DIRECT) local storage so that
the clauses run on any local filesystem (see CLAUSES.md, "Reading of storage").

With a storage URL (``--storage-url s3://bucket/prefix`` or ``CONFORMANCE_STORAGE_URL``)
every checkpoint id is a URL under a fresh prefix (:func:`location`), managers get the
backend's public ``FsspecStorageConfig(url=...)``, and the clauses inspect what was
written through fsspec (:func:`files`, :func:`read_bytes`), never through the backend.
Endpoint and credentials come from the environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``...), which rank and writer processes inherit.
"""

from __future__ import annotations

import atexit
import io
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

from conformance import backend

SaveMode = Literal["sync", "async"]
WRITE_TIMEOUT_S = 120.0
_UNSET: Any = object()
STORAGE_URL_ENV = "CONFORMANCE_STORAGE_URL"
# One prefix per pytest session (set by the controller, inherited by xdist workers and ranks).
STORAGE_RUN_ENV = "CONFORMANCE_STORAGE_RUN"
LOCAL_SCHEMES = ("", "file")


@dataclass(frozen=True)
class Url:
    """A checkpoint location on an object store: joins with ``/`` like a Path, ``str()`` is the URL.

    ``pathlib`` cannot hold a URL (it folds ``s3://`` into ``s3:/``), so clauses that build ids with
    ``root / "c"`` get this instead of a Path when the suite runs against a storage URL.
    """

    url: str

    def __truediv__(self, part: str) -> Url:
        return Url(f"{self.url.rstrip('/')}/{part}")

    def __str__(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]


Where: TypeAlias = "Path | Url"


def storage_url() -> str:
    """The storage URL under test ('' for the local filesystem); an environment variable so ranks see it."""
    return os.environ.get(STORAGE_URL_ENV, "").strip().rstrip("/")


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else ""


def remote() -> bool:
    """True when checkpoints go to a non-local store (``s3://...``): local-only clauses are not measured."""
    return _scheme(storage_url()) not in LOCAL_SCHEMES


def run_id() -> str:
    """This session's prefix under the storage URL; made on first use and kept in the environment."""
    if not os.environ.get(STORAGE_RUN_ENV):
        os.environ[STORAGE_RUN_ENV] = f"conformance-{uuid.uuid4().hex[:12]}"
    return os.environ[STORAGE_RUN_ENV]


def location(root: str | Path) -> Where:
    """A Url for a URL string, a Path otherwise: what rank programs get back from their string argument."""
    text = str(root)
    return Url(text) if _scheme(text) not in LOCAL_SCHEMES else Path(text.removeprefix("file://"))


def fresh_root(tmp_path: Path, label: str) -> Where:
    """Where one test puts its checkpoints: ``tmp_path`` locally, else a new prefix under the storage URL."""
    url = storage_url()
    if not url:
        return tmp_path
    name = f"{re.sub(r'[^A-Za-z0-9_-]+', '-', label)[:60]}-{uuid.uuid4().hex[:8]}"
    return location(f"{url}/{run_id()}/{name}")


def buffered_storage() -> Any:
    """LocalFileSystemStorageConfig(use_direct_io=False) from the backend."""
    cfg = backend.name("storage.filesystem", "LocalFileSystemStorageConfig")
    return cfg(use_direct_io=False)


def storage_config() -> Any:
    """The storage the clauses run on: the backend's ``FsspecStorageConfig(url=...)`` for a storage URL,
    else buffered local storage. Only the public name is used, so a backend lacking it is not measured."""
    if not remote():
        return buffered_storage()
    return backend.name("", "FsspecStorageConfig")(url=storage_url())


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
        kwargs["storage_config"] = storage_config()
    return manager_cls.Config(**kwargs)


def save(manager: Any, path: Where | str, payload: Mapping[str, Any], timeout: float = WRITE_TIMEOUT_S) -> None:
    """Save and wait until durable, whatever the save mode returns."""
    result = manager.save(str(path), payload)
    if isinstance(result, Future):
        result.result(timeout=timeout)


def _fs(url: Url) -> tuple[Any, str]:
    """(fsspec filesystem, path on it) for ``url``, its listing cache dropped so a new object is seen."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url.url)
    fs.invalidate_cache()
    return fs, path


def files(root: Where | str) -> set[str]:
    """All regular files (objects) under ``root`` as POSIX paths relative to it; empty if there is none."""
    root = location(root) if isinstance(root, str) else root
    if isinstance(root, Url):
        fs, base = _fs(root)
        base = base.rstrip("/")
        return {p[len(base) + 1 :] for p in fs.find(base) if p.startswith(base + "/")}
    out: set[str] = set()
    for dirpath, _dirs, names in os.walk(root):
        for fname in names:
            out.add((Path(dirpath) / fname).relative_to(root).as_posix())
    return out


def read_bytes(where: Where) -> bytes:
    """The bytes of one file of a checkpoint, read directly from the store (not through the backend)."""
    if isinstance(where, Url):
        fs, path = _fs(where)
        return bytes(fs.cat_file(path))
    return where.read_bytes()


def read_text(where: Where) -> str:
    return read_bytes(where).decode("utf-8")


def write_bytes(where: Where, data: bytes) -> None:
    """Write one file (making parent directories locally): planted files and the suite's own records."""
    if isinstance(where, Url):
        fs, path = _fs(where)
        fs.pipe_file(path, data)
        return
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(data)


def remove(where: Where) -> None:
    """Delete one file (object) of a checkpoint."""
    if isinstance(where, Url):
        fs, path = _fs(where)
        fs.rm_file(path)
        return
    where.unlink()


def copy_tree(src: Where, dst: Where) -> None:
    """Copy a checkpoint to a new id, file by file (links kept as links locally)."""
    if isinstance(src, Path) and isinstance(dst, Path):
        shutil.copytree(src, dst, symlinks=True)
        return
    for rel in sorted(files(src)):
        write_bytes(dst / rel, read_bytes(src / rel))


def torch_load(where: Where) -> Any:
    """``torch.load`` of one file (trusted mode: the suite reads files it wrote itself)."""
    import torch

    return torch.load(io.BytesIO(read_bytes(where)), weights_only=False)


def torch_save(value: Any, where: Where) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    write_bytes(where, buf.getvalue())


_FETCHED: list[str] = []


def local_file(where: Where) -> Path:
    """A local path holding the file's bytes, for readers that want a path (safetensors ``safe_open``)."""
    if isinstance(where, Path):
        return where
    if not _FETCHED:
        _FETCHED.append(tempfile.mkdtemp(prefix="conformance-fetch-"))
        atexit.register(shutil.rmtree, _FETCHED[0], True)
    out = Path(_FETCHED[0]) / f"{uuid.uuid4().hex[:8]}-{where.name}"
    out.write_bytes(read_bytes(where))
    return out


def same_location(a: Any, b: Where) -> bool:
    """Whether a location a backend reports (a Path, a str, a URL) names ``b``.

    The document types a resharder's ``source_path`` as a ``Path``, and a Path of a URL folds ``s3://`` into
    ``s3:/``: that form names the same location.
    """
    if isinstance(b, Url):
        return str(a).rstrip("/") == b.url.rstrip("/") or Path(str(a)) == Path(b.url)
    return Path(str(a)) == b


def layout(path: str, fmt: str, *args: Any, **kwargs: Any) -> Any:
    """LayoutInfo(path, <Format>(*args, **kwargs)) from checkpoint_layout."""
    fmt_cls = backend.name("checkpoint_layout", fmt)
    return backend.name("checkpoint_layout", "LayoutInfo")(path, fmt_cls(*args, **kwargs))


def spec(**kwargs: Any) -> Any:
    """ItemSpec(**kwargs) from the package top level."""
    return backend.name("", "ItemSpec")(**kwargs)


def raised_by(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException | None:
    """What ``fn(*args, **kwargs)`` raised, or None: lets a clause assert on it outside the ``except``, so the
    report's reason is the clause's own message, not the first line of the chained exception."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return exc
    return None
