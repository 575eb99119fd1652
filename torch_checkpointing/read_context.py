"""The one read context: every file a load opens goes through a `CheckpointReadContext`.

It knows the checkpoint directory and its manifest, and does in one place what makes a load trustworthy:

* the directory is pinned for the whole load (opened once; on a local filesystem every file is opened relative
  to that directory descriptor), so a concurrent overwrite of the same id cannot mix two saves;
* containment: a path read from checkpoint data must be relative and stay inside; on a local filesystem no
  component may be a symlink, and the file must be a regular file (a FIFO would hang the load);
* the manifest: a file the manifest does not list is never read; a listed file is looked up by its path (so a
  file written once by the lowest rank is checked on every rank against that rank's record);
* verification: size always, CRC32 (the checksum the writer records) by default, computed off the caller's
  thread while decoding proceeds.

Each checked file stays open (its descriptor held) until the context closes, so what was verified is what is
decoded, even if the directory is replaced meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import logging
import mmap
import os
import posixpath
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_checkpointing.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from torch_checkpointing.manifest import (
    INCOMPLETE_MARKER,
    MANIFEST_FILE_NAME,
    FileRecord,
    Manifest,
    _BadConstant,
    check_json_tree,
    parse_manifest,
)
from torch_checkpointing.storage.base_storage import ReadArgs, Storage

__all__ = ["MAX_METADATA_BYTES", "CheckedFile", "CheckpointReadContext", "ReadPolicy", "checked_relative_path", "crc32"]

logger = logging.getLogger("torch_checkpointing.read_context")

MAX_METADATA_BYTES = 256 * 1024 * 1024
_CRC_CHUNK = 16 * 1024 * 1024

try:  # ISA-L computes the same CRC32 as zlib about four times faster; zlib is the fallback when absent.
    from isal import isal_zlib as _fast_zlib

    _crc32: Callable[[Any, int], int] = _fast_zlib.crc32
    _crc32_combine: Callable[[int, int, int], int] | None = _fast_zlib.crc32_combine
except ImportError:  # pragma: no cover - depends on the optional extra
    import zlib

    _crc32 = zlib.crc32
    _crc32_combine = None


@dataclass(frozen=True)
class ReadPolicy:
    """What a load checks; built from `CheckpointLoaderConfig`."""

    verify_checksums: bool = True
    allow_legacy_checkpoints: bool = True


def checked_relative_path(path: Any, what: str) -> str:
    """The normalised form of a path read from checkpoint data, refused unless relative and inside."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise UnsafeCheckpointError(f"{what}: file path {path!r} is not a non-empty string.")
    if posixpath.isabs(path) or path.startswith("\\") or (len(path) > 1 and path[1] == ":"):
        raise UnsafeCheckpointError(f"{what}: file path {path!r} is absolute; checkpoint paths must be relative.")
    normal = posixpath.normpath(path)
    if normal in (".", "..") or normal.startswith("../"):
        raise UnsafeCheckpointError(f"{what}: file path {path!r} leaves the checkpoint directory.")
    return normal


def crc32(view: memoryview, pool: ThreadPoolExecutor | None = None) -> int:
    """CRC32 of a buffer; large buffers are split over `pool` and combined when the library can combine."""
    n = len(view)
    if pool is None or _crc32_combine is None or n <= 2 * _CRC_CHUNK:
        return _crc32(view, 0) & 0xFFFFFFFF
    chunks = [view[i : i + _CRC_CHUNK] for i in range(0, n, _CRC_CHUNK)]
    parts = list(pool.map(lambda c: _crc32(c, 0), chunks))
    value = parts[0]
    for part, chunk in zip(parts[1:], chunks[1:], strict=True):
        value = _crc32_combine(value, part, len(chunk))
    return value & 0xFFFFFFFF


@dataclass
class CheckedFile:
    """One opened, contained, regular file; `verified` resolves once its checksum matched (or fails)."""

    rel: str
    size: int
    record: FileRecord | None
    fd: int | None = None
    data: bytes | None = None
    verified: Future[None] = field(default_factory=Future)

    def local_path(self) -> str | None:
        return f"/proc/self/fd/{self.fd}" if self.fd is not None and _HAVE_PROC_FD else None


_HAVE_PROC_FD = os.path.isdir("/proc/self/fd")


class CheckpointReadContext:
    """Everything one load reads from one checkpoint directory. Use as a context manager."""

    def __init__(self, storage: Storage, checkpoint_id: str, policy: ReadPolicy) -> None:
        self.storage = storage
        self.root = Path(checkpoint_id)
        self.policy = policy
        self.manifest: Manifest | None = None
        self._dirfd: int | None = None
        self._files: dict[str, CheckedFile] = {}
        self._by_path: dict[str, FileRecord] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._chunk_pool: ThreadPoolExecutor | None = None
        self._read_ahead = False
        self._metadata: Any = _UNSET

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> CheckpointReadContext:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for pool in (self._pool, self._chunk_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._chunk_pool = None
        for f in self._files.values():
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
        self._files.clear()
        if self._dirfd is not None:
            os.close(self._dirfd)
            self._dirfd = None

    def _open(self) -> None:
        local = self.storage.local_path(self.root)
        if local is not None:
            try:
                self._dirfd = os.open(local, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise FileNotFoundError(f"Checkpoint path {self.root} does not exist.") from None
            except NotADirectoryError:
                raise FileNotFoundError(f"Checkpoint path {self.root} is not a directory.") from None
        elif not self.storage.isdir(self.root):
            raise FileNotFoundError(f"Checkpoint path {self.root} does not exist.")
        if self._exists(INCOMPLETE_MARKER):
            # Checked first: a writer killed between writing the manifest and removing the marker leaves both.
            raise IncompleteCheckpointError(
                f"Checkpoint {self.root} is incomplete: its save never committed. Load an earlier checkpoint."
            )
        if not self._exists(MANIFEST_FILE_NAME):
            self._no_manifest()
            return
        text = self._read_bounded(MANIFEST_FILE_NAME)
        self.manifest = parse_manifest(text, str(self.root / MANIFEST_FILE_NAME))
        where = str(self.root / MANIFEST_FILE_NAME)
        self._by_path = {checked_relative_path(r.path, where): r for r in self.manifest.files}
        m = self.manifest
        if m.metadata_file is not None:
            name = checked_relative_path(m.metadata_file, f"{where}: field 'metadata_file'")
            self.manifest = m = dataclasses.replace(m, metadata_file=name)
            if m.metadata_size is not None and m.metadata_crc32 is not None:
                self._by_path[name] = FileRecord("<sharding metadata>", 0, name, m.metadata_size, m.metadata_crc32, {})

    def _no_manifest(self) -> None:
        if not self.storage.atomic_rename:
            # Object stores (issue 14): the manifest, written last, IS the commit. Files without one are a save
            # still running or one that died; the published release never wrote to such a store.
            raise IncompleteCheckpointError(
                f"Checkpoint {self.root} has no {MANIFEST_FILE_NAME}: on this store (no atomic rename) the manifest "
                f"is written last and is the commit, so this is a save that is still running or never finished. "
                f"Load an earlier checkpoint."
            )
        if not self.policy.allow_legacy_checkpoints:
            raise IncompleteCheckpointError(
                f"Checkpoint {self.root} has no {MANIFEST_FILE_NAME}, so nothing says its save committed and "
                f"nothing can be verified (its manifest was removed, or it was written without one by the "
                f"published release), and this load asked for verification (verify_checksums=True or "
                f"allow_legacy_checkpoints=False). Load an intact checkpoint, or, if you trust this one, load it "
                f"with the defaults (unverified, with a warning)."
            )
        logger.warning(
            "Loading %s without a manifest (allow_legacy_checkpoints=True): files are checked for containment "
            "and type only; their contents cannot be verified.",
            self.root,
        )

    # ------------------------------------------------------------------ manifest queries

    def record(self, rel_path: str) -> FileRecord | None:
        """The manifest record of a file, looked up by path (the record of the rank that wrote it)."""
        return self._by_path.get(posixpath.normpath(rel_path))

    def lists(self, rel_path: str) -> bool:
        """Whether the checkpoint holds this file: listed in the manifest, or (legacy) present."""
        if self.manifest is not None:
            normal = posixpath.normpath(rel_path)
            return normal in self._by_path or normal == self.manifest.metadata_file
        return self._exists(checked_relative_path(rel_path, str(self.root)))

    # ------------------------------------------------------------------ opening and checking files

    def check(self, rel_path: str, what: str) -> CheckedFile:
        """Open a file the checkpoint holds, check containment, type and size, and start verifying it.

        `what` says who wants the file (an item key, the sharding metadata) for the error message.
        """
        rel = checked_relative_path(rel_path, f"{what} in checkpoint {self.root}")
        known = self._files.get(rel)
        if known is not None:
            return known
        record = self.record(rel)
        if self.manifest is not None and record is None and rel != self.manifest.metadata_file:
            raise UnsafeCheckpointError(
                f"File {self.root / rel} ({what}) is not listed in the checkpoint's manifest; an unlisted file is "
                f"never read. Load an untouched copy of the checkpoint."
            )
        checked = self._open_file(rel, record, what)
        self._files[rel] = checked
        self._start_verify(checked, what)
        return checked

    def wait_verified(self) -> None:
        """Block until every checked file is verified; raise the first failure (in path order)."""
        for rel in sorted(self._files):
            self._files[rel].verified.result()

    def _open_file(self, rel: str, record: FileRecord | None, what: str) -> CheckedFile:
        if self._dirfd is None:
            path = self.root / rel
            if not self.storage.exists(path):
                raise self._missing(rel, what)
            if not self.policy.verify_checksums:
                # Nothing to checksum: the size from one HEAD, the bytes on demand (a resharding read then fetches
                # only its byte ranges, issue 14), not the whole object up front.
                return CheckedFile(rel, self.storage.getsize(path), record)
            data = self.storage.read(path)
            return CheckedFile(rel, len(data), record, data=data)
        fd = self._open_contained(rel, what)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeCheckpointError(
                    f"File {self.root / rel} ({what}) is not a regular file (mode {stat.filemode(st.st_mode)}); "
                    f"a checkpoint holds only regular files. Load an untouched copy of the checkpoint."
                )
        except BaseException:
            os.close(fd)
            raise
        return CheckedFile(rel, st.st_size, record, fd=fd)

    def _open_contained(self, rel: str, what: str) -> int:
        """Open `rel` below the pinned directory, refusing symlinks at every component and blocking opens."""
        assert self._dirfd is not None
        parts = rel.split("/")
        current = self._dirfd
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
                try:
                    fd = os.open(part, flags, dir_fd=current)
                except FileNotFoundError:
                    raise self._missing(rel, what) from None
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                        raise UnsafeCheckpointError(
                            f"File {self.root / rel} ({what}) is reached through a symbolic link or a non-directory "
                            f"({exc.strerror}); checkpoint files must be regular files inside the directory."
                        ) from None
                    raise CorruptCheckpointError(f"Cannot open {self.root / rel} ({what}): {exc}") from exc
                if current != self._dirfd:
                    os.close(current)
                current = fd
            return current
        except BaseException:
            if current != self._dirfd:
                os.close(current)
            raise

    def _missing(self, rel: str, what: str) -> CheckpointError:
        if self.manifest is not None:
            return CorruptCheckpointError(
                f"File {self.root / rel} ({what}) is listed in the checkpoint's manifest but missing: the checkpoint "
                f"was damaged, or replaced while this load ran (retry the load if another process overwrote it)."
            )
        return CorruptCheckpointError(f"File {self.root / rel} ({what}) does not exist.")

    def _start_verify(self, checked: CheckedFile, what: str) -> None:
        record = checked.record
        if record is not None and checked.size != record.size:
            checked.verified.set_exception(
                CorruptCheckpointError(
                    f"File {self.root / checked.rel} ({what}) has {checked.size} bytes but the manifest records "
                    f"{record.size}: the checkpoint was modified or damaged after it was committed."
                )
            )
            checked.verified.result()  # raise now: the size is known without reading a byte
        if record is None or not self.policy.verify_checksums:
            checked.verified.set_result(None)
            return
        pool = self._get_pool()
        inner = pool.submit(self._verify, checked, record, what)
        inner.add_done_callback(lambda f: _forward(f, checked.verified))

    def _get_chunk_pool(self) -> ThreadPoolExecutor:
        # Separate from the per-file pool: a file task waiting on chunk tasks in its own pool could deadlock.
        if self._chunk_pool is None:
            self._chunk_pool = ThreadPoolExecutor(4, thread_name_prefix="ckpt-crc")
        return self._chunk_pool

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="ckpt-verify")
        return self._pool

    def _verify(self, checked: CheckedFile, record: FileRecord, what: str) -> None:
        actual = self._checksum(checked)
        if actual != record.crc32:
            raise CorruptCheckpointError(
                f"File {self.root / checked.rel} ({what}) fails its CRC32 check (manifest {record.crc32:#010x}, "
                f"file {actual:#010x}): the checkpoint is damaged. Load an earlier checkpoint."
            )

    def _checksum(self, checked: CheckedFile) -> int:
        if checked.data is not None:
            return crc32(memoryview(checked.data))
        if checked.size == 0:
            return 0
        assert checked.fd is not None
        with mmap.mmap(checked.fd, checked.size, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                # Chunks are checksummed on threads of their own where the library can combine them.
                return crc32(view, self._get_chunk_pool())
            finally:
                view.release()

    # ------------------------------------------------------------------ reading checked files

    @contextlib.contextmanager
    def reading_ahead(self) -> Iterator[None]:
        """Within this block reads do not wait for their file's checksum.

        For the loader's decode step only: it overlaps decoding with verification and uses nothing it decoded
        before `wait_verified()` has returned. Every other read (a resharder's) waits for its file's checksum.
        """
        self._read_ahead = True
        try:
            yield
        finally:
            self._read_ahead = False

    def _checked_for_read(self, rel_path: str, what: str) -> CheckedFile:
        checked = self.check(rel_path, what)
        if not self._read_ahead:
            checked.verified.result()
        return checked

    def read_bytes(self, rel_path: str, what: str = "file") -> bytes:
        checked = self._checked_for_read(rel_path, what)
        if checked.data is not None:
            return checked.data
        if checked.fd is None:  # a non-local store, read unverified: fetched now
            return self.storage.read(self.root / checked.rel)
        return _pread_all(checked.fd, 0, checked.size)

    def read_range(self, rel_path: str, offset: int, length: int, what: str = "file") -> bytes:
        checked = self._checked_for_read(rel_path, what)
        if offset < 0 or length < 0 or offset + length > checked.size:
            raise CorruptCheckpointError(
                f"Read of bytes [{offset}, {offset + length}) of {self.root / checked.rel} ({what}) lies outside "
                f"its {checked.size} bytes: the file's header is damaged."
            )
        if checked.data is not None:
            return checked.data[offset : offset + length]
        if checked.fd is None:  # a non-local store, read unverified: a ranged read of just these bytes
            return self.storage.read_range(self.root / checked.rel, offset, length)
        return _pread_all(checked.fd, offset, length)

    def local_path(self, rel_path: str, what: str = "file") -> str | None:
        return self._checked_for_read(rel_path, what).local_path()

    def _exists(self, rel: str) -> bool:
        if self._dirfd is None:
            return self.storage.exists(self.root / rel)
        try:
            os.stat(rel, dir_fd=self._dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def _read_bounded(self, rel: str) -> bytes:
        """Read a root file that no manifest can vouch for (the manifest itself), bounded, regular only."""
        if self._dirfd is None:
            data = self.storage.read(self.root / rel)
            if len(data) > MAX_METADATA_BYTES:
                raise CorruptCheckpointError(f"{self.root / rel} is larger than {MAX_METADATA_BYTES} bytes.")
            return data
        fd = self._open_contained(rel, "manifest")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeCheckpointError(f"{self.root / rel} is not a regular file; it cannot be a manifest.")
            if st.st_size > MAX_METADATA_BYTES:
                raise CorruptCheckpointError(f"{self.root / rel} is larger than {MAX_METADATA_BYTES} bytes.")
            return _pread_all(fd, 0, st.st_size)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ the storage view

    def storage_view(self) -> Storage:
        """A read-only `Storage` whose every read goes through this context (for resharders and decoders)."""
        return _ContextStorage(self)

    def relative(self, path: Path | str) -> str:
        """`path` (under the checkpoint as the caller named it) relative to the checkpoint directory."""
        p = Path(path)
        try:
            rel = p.relative_to(self.root)
        except ValueError:
            raise UnsafeCheckpointError(
                f"Path {p} lies outside the checkpoint {self.root} being loaded; a load reads only its own files."
            ) from None
        return checked_relative_path(rel.as_posix(), f"path {p}")


def parse_json_bounded(data: bytes, where: str, max_depth: int = 64) -> Any:
    """JSON from checkpoint data: UTF-8, no NaN/Infinity, nesting bounded; errors name the file and field."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_BadConstant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({type(exc).__name__}: {exc}).") from None
    check_json_tree(value, where, max_depth)
    return value


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    view = memoryview(buf)
    done = 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(f"File ended after {offset + done} bytes; expected {offset + length}.")
        done += n
    return bytes(buf)


def _forward(inner: Future[None], outer: Future[None]) -> None:
    exc = inner.exception()
    if exc is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(None)


_UNSET: Any = object()


class _ContextStorage(Storage):
    """A read-only Storage over one read context: the seam that keeps `Resharder.load(..., storage)` working."""

    def __init__(self, ctx: CheckpointReadContext) -> None:
        self._ctx = ctx

    def _rel(self, path: Path) -> str:
        return self._ctx.relative(path)

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        return io.BytesIO(self.read(path))  # type: ignore[return-value]

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        return self._ctx.read_bytes(self._rel(path), str(path))

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        return self._ctx.read_range(self._rel(path), offset, length, str(path))

    def local_path(self, path: Path) -> str | None:
        return self._ctx.local_path(self._rel(path), str(path))

    def exists(self, path: Path) -> bool:
        return self._ctx.lists(self._rel(path))

    def getsize(self, path: Path) -> int:
        return self._ctx.check(self._rel(path), str(path)).size

    def isdir(self, path: Path) -> bool:
        return Path(path) == self._ctx.root or self._ctx.storage.isdir(path)

    def ls(self, path: Path) -> list[str]:
        prefix = "" if Path(path) == self._ctx.root else self._rel(path) + "/"
        names = {p[len(prefix) :].split("/")[0] for p in self._ctx._by_path if p.startswith(prefix)}
        return sorted(names)

    def remap_path(self, path: Path) -> str:
        return str(path)

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError("A load's storage view is read-only; resharders must not write to the checkpoint.")

    stream_write = write = delete = mkdir = rmdir = rename = _read_only
