"""Storage backends for the engine's tests.

* `MemoryStorage`: every byte lives in a process-local dict, so a save or load that touched the disk instead
  of the configured backend is caught. Its config pickles (by name) but the dict does not cross processes:
  use it with sync saves.
* `RecordingStorage`: the local filesystem backend that logs each call to a file and obeys control files
  (delay, block). Both work across processes, so async saves (whose writer is a spawned process) can be
  slowed, blocked mid-file and observed.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

__all__ = [
    "Control",
    "MemoryStorage",
    "MemoryStorageConfig",
    "MemoryStore",
    "RecordingStorage",
    "RecordingStorageConfig",
    "SlowCopy",
    "files_under",
    "free_port",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def files_under(root: Path) -> set[str]:
    """Relative paths of every file below `root` (hidden ones included)."""
    return {str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file()}


def _norm(path: Any) -> str:
    return posixpath.normpath(os.fspath(path))


@dataclass
class MemoryStore:
    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "."})
    calls: list[tuple[str, str]] = field(default_factory=list)


_STORES: dict[str, MemoryStore] = {}


@dataclass
class MemoryStorageConfig(StorageConfig):
    """Names a process-local store; equal names share one store."""

    name: str = field(default_factory=lambda: uuid.uuid4().hex)

    def create_storage(self) -> MemoryStorage:
        return MemoryStorage(self.store)

    @property
    def store(self) -> MemoryStore:
        return _STORES.setdefault(self.name, MemoryStore())


class _MemoryWriteStream(io.BytesIO):
    def __init__(self, store: MemoryStore, path: str) -> None:
        super().__init__()
        self._store = store
        self._path = path

    def close(self) -> None:
        if not self.closed:
            self._store.files[self._path] = self.getvalue()
        super().close()


class MemoryStorage(Storage):
    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def _log(self, op: str, path: Any) -> str:
        p = _norm(path)
        self.store.calls.append((op, p))
        return p

    def _check_parent(self, p: str) -> None:
        parent = posixpath.dirname(p) or "."
        if parent not in self.store.dirs:
            raise RuntimeError(f"Parent directory does not exist, create it!: {parent}")

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        p = self._log("read", path)
        if p not in self.store.files:
            raise FileNotFoundError(p)
        return io.BytesIO(self.store.files[p])  # type: ignore[return-value]

    def stream_write(self, path: Path) -> io.IOBase:
        p = self._log("write", path)
        self._check_parent(p)
        return _MemoryWriteStream(self.store, p)

    def write(self, path: Path, data: Any) -> None:
        p = self._log("write", path)
        self._check_parent(p)
        self.store.files[p] = bytes(memoryview(data).cast("B"))

    def delete(self, path: Path) -> None:
        p = self._log("delete", path)
        if p not in self.store.files:
            raise FileNotFoundError(p)
        del self.store.files[p]

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        p = self._log("mkdir", path)
        while p not in self.store.dirs:
            self.store.dirs.add(p)
            p = posixpath.dirname(p) or "."

    def _below(self, p: str, name: str) -> bool:
        return name == p or name.startswith(p.rstrip("/") + "/")

    def rmdir(self, path: Path) -> None:
        p = self._log("rmdir", path)
        self.store.files = {k: v for k, v in self.store.files.items() if not self._below(p, k)}
        self.store.dirs = {d for d in self.store.dirs if not self._below(p, d)} | {"/", "."}

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        is_cross_link: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        src, dst = self._log("rename", src_path), _norm(dst_path)
        if dst in self.store.files or dst in self.store.dirs:
            raise FileExistsError(dst)

        def move(name: str) -> str:
            return dst + name[len(src) :] if self._below(src, name) else name

        self.store.files = {move(k): v for k, v in self.store.files.items()}
        self.store.dirs = {move(d) for d in self.store.dirs}

    def ls(self, path: Path) -> list[str]:
        p = self._log("ls", path)
        names = set()
        for name in [*self.store.files, *self.store.dirs]:
            if name != p and posixpath.dirname(name) == p:
                names.add(posixpath.basename(name))
        return sorted(names)

    def exists(self, path: Path) -> bool:
        p = self._log("exists", path)
        return p in self.store.files or p in self.store.dirs

    def getsize(self, path: Path) -> int:
        p = self._log("getsize", path)
        if p not in self.store.files:
            raise FileNotFoundError(p)
        return len(self.store.files[p])

    def isdir(self, path: Path) -> bool:
        return self._log("isdir", path) in self.store.dirs

    def remap_path(self, path: Path) -> str:
        return "memory://" + _norm(path)

    def sync_directory(self, path: Path) -> None:
        self._log("sync_directory", path)

    def replace_directory(self, src: Path, dst: Path) -> None:
        self._log("replace_directory", src)
        super().replace_directory(src, dst)


# ----------------------------------------------------------------------------------- recording storage


class Control:
    """Files in `root` that steer a `RecordingStorage` in any process, and its call log."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def log_path(self) -> Path:
        return self.root / "calls.log"

    def set_delay(self, seconds: float) -> None:
        """Every stream_write waits this long before opening the file."""
        (self.root / "delay_s").write_text(str(seconds))

    def block(self, substring: str) -> None:
        """The first write into a file whose path contains `substring` hands over its bytes, then blocks.

        "before rmdir": the first directory removal blocks before it starts (a swap's removal of the replaced copy).
        "after open NAME": the first stream_write of a file whose path contains NAME blocks once it has created the
        file, before it returns the stream.
        """
        (self.root / "blocked").unlink(missing_ok=True)
        (self.root / "block_on").write_text(substring)

    def wait_blocked(self, timeout: float = 120.0) -> int:
        """The pid of the process that blocked (`block`). `timeout` only stops a hang: the first write of an async
        manager includes starting its writer process, 18 s seen on 2 busy cores under coverage."""
        deadline = time.monotonic() + timeout
        marker = self.root / "blocked"
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text():
                return int(marker.read_text())
            time.sleep(0.02)
        raise TimeoutError(f"no write blocked within {timeout}s")

    def fail_reads(self, pid: int, substring: str) -> None:
        """Every read by process `pid` of a path containing `substring` raises OSError(EIO), until `reset`."""
        (self.root / "fail_read").write_text(f"{pid}\t{substring}")

    def reset(self) -> None:
        for name in ("delay_s", "block_on", "blocked", "calls.log", "fail_read"):
            (self.root / name).unlink(missing_ok=True)

    def calls(self) -> list[tuple[str, ...]]:
        """(pid, op, path[, path2]) per call, in order."""
        if not self.log_path.exists():
            return []
        return [tuple(line.split("\t")) for line in self.log_path.read_text().splitlines() if line]


@dataclass
class RecordingStorageConfig(LocalFileSystemStorageConfig):
    control_dir: str = ""
    use_direct_io: bool = False

    def create_storage(self) -> RecordingStorage:
        return RecordingStorage(self)


class _BlockingStream:
    def __init__(self, inner: Any, storage: RecordingStorage, path: str) -> None:
        self.inner = inner
        self.storage = storage
        self.path = path
        # The file the local stream created, as the real stream names it: a failed save removes only that.
        self.identity = getattr(inner, "identity", None)

    def write(self, data: Any) -> int:
        n = self.inner.write(data)
        self.storage._maybe_block(self.path)
        return n

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()
        self.storage._log("closed", self.path)

    def __enter__(self) -> _BlockingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecordingStorage(LocalFileSystemStorage):
    config: RecordingStorageConfig

    @property
    def control(self) -> Control:
        return Control(self.config.control_dir)

    def _log(self, op: str, *paths: Any) -> None:
        line = "\t".join([str(os.getpid()), op, *(os.fspath(p) for p in paths)]) + "\n"
        fd = os.open(self.control.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _maybe_block(self, path: str) -> None:
        root = self.control.root
        block_on = root / "block_on"
        try:
            substring = block_on.read_text()
        except FileNotFoundError:
            return
        if substring and substring in path and not (root / "blocked").exists():
            tmp = root / f"blocked.{os.getpid()}"
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, root / "blocked")
            while block_on.exists():
                time.sleep(0.02)

    def stream_write(self, path: Path) -> Any:
        self._log("stream_write", path)
        try:
            delay = float((self.control.root / "delay_s").read_text())
        except FileNotFoundError:
            delay = 0.0
        if delay:
            time.sleep(delay)
        stream = super().stream_write(path)
        try:
            self._maybe_block_after_open(os.fspath(path))
        except BaseException:
            stream.close()
            raise
        return _BlockingStream(stream, self, os.fspath(path))

    def _maybe_block_after_open(self, path: str) -> None:
        """`Control.block("after open NAME")`; a plain file name blocks in the first write instead."""
        try:
            substring = (self.control.root / "block_on").read_text()
        except FileNotFoundError:
            return
        prefix = "after open "
        if substring.startswith(prefix) and substring[len(prefix) :] in path:
            self._maybe_block(substring)

    def write(self, path: Path, data: Any) -> None:
        self._log("write", path)
        with LocalFileSystemStorage.stream_write(self, path) as stream:
            stream.write(data)
            self._maybe_block(os.fspath(path))

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        self._log("read", path)
        try:
            pid, substring = (self.control.root / "fail_read").read_text().split("\t", 1)
        except FileNotFoundError:
            pass
        else:
            if int(pid) == os.getpid() and substring in os.fspath(path):
                raise OSError(errno.EIO, "Input/output error (Control.fail_reads)", os.fspath(path))
        return super().read(path, read_args)

    def local_path(self, path: Path) -> str | None:
        self._log("local_path", path)
        return super().local_path(path)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        self._log("mkdir", path)
        super().mkdir(path, recursive)

    def delete(self, path: Path) -> None:
        self._log("delete", path)
        super().delete(path)

    def rmdir(self, path: Path) -> None:
        self._log("rmdir", path)
        self._maybe_block(f"before rmdir {os.fspath(path)}")  # `Control.block("before rmdir")`
        super().rmdir(path)

    def rename(self, src_path: Path, dst_path: Path, *args: Any, **kwargs: Any) -> None:
        self._log("rename", src_path, dst_path)
        super().rename(src_path, dst_path, *args, **kwargs)

    def sync_directory(self, path: Path) -> None:
        self._log("sync_directory", path)
        super().sync_directory(path)

    def replace_directory(self, src: Path, dst: Path) -> None:
        self._log("replace_directory", src, dst)
        super().replace_directory(src, dst)


class SlowCopy:
    """A value whose deep copy takes `seconds`: stretches a save's staging copy so that tests can watch it.

    `SlowCopy.copies` counts the deep copies made in this process, so a test can see whether a value was staged.
    """

    copies: ClassVar[int] = 0
    finished: ClassVar[int] = 0  # the deep copies that have returned
    # Set: a deep copy waits for it (at most `seconds`) instead of sleeping, so that a test decides when a copy
    # ends, whatever the machine's load.
    gate: ClassVar[threading.Event | None] = None

    def __init__(self, seconds: float, payload: int = 0) -> None:
        self.seconds = seconds
        self.payload = payload

    def __deepcopy__(self, memo: dict[int, Any]) -> SlowCopy:
        SlowCopy.copies += 1
        if SlowCopy.gate is None:
            time.sleep(self.seconds)
        else:
            SlowCopy.gate.wait(self.seconds)
        SlowCopy.finished += 1
        return SlowCopy(self.seconds, self.payload)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlowCopy) and (other.seconds, other.payload) == (self.seconds, self.payload)

    def __hash__(self) -> int:
        return hash((self.seconds, self.payload))


def controlled_manager(control: Control, items: dict[str, Any] | None = None) -> Iterator[tuple[Any, Control]]:
    """An async manager over RecordingStorage driven by `control`; closed (errors swallowed) at the end.

    Used as the body of module-scoped fixtures: `yield from controlled_manager(...)`.
    """
    from torch_checkpointing import CheckpointManager

    manager = CheckpointManager(
        CheckpointManager.Config(
            items=items or {}, storage_config=RecordingStorageConfig(control_dir=str(control.root))
        )
    )
    yield manager, control
    control.reset()
    # close() re-raises the last write's error; a test that failed mid-way may have left one.
    with contextlib.suppress(Exception):
        manager.close()


def with_clean_controls(manager: Any, control: Control, timeout: float = 120) -> Iterator[tuple[Any, Control]]:
    """Per-test wrapper: controls reset before and after, and no write left in flight."""
    control.reset()
    yield manager, control
    control.reset()
    # The public API has no wait that leaves the manager open: close() closes it, lock() waits for staging
    # only, prewarm_staging() refuses while a write runs, and the test's save() Futures are not ours to see.
    # Hence the saver's own wait (what close() calls first); an error it re-raises was the test's to report.
    with contextlib.suppress(Exception):
        manager._saver.wait(timeout)


@dataclass
class NoExchangeRecordingStorageConfig(RecordingStorageConfig):
    """A `RecordingStorage` on a filesystem without renameat2 RENAME_EXCHANGE: a replace takes the base class's
    two renames (the old checkpoint aside, then the new one in). `Control.block("after rename ... .old_")` stops a
    process right after its first rename."""

    def create_storage(self) -> NoExchangeRecordingStorage:
        return NoExchangeRecordingStorage(self)


class NoExchangeRecordingStorage(RecordingStorage):
    def rename(self, src_path: Path, dst_path: Path, *args: Any, **kwargs: Any) -> None:
        super().rename(src_path, dst_path, *args, **kwargs)
        self._maybe_block(f"after rename {os.fspath(src_path)} {os.fspath(dst_path)}")

    def replace_directory(self, src: Path, dst: Path) -> None:
        self._log("replace_directory", src, dst)
        Storage.replace_directory(self, src, dst)
