"""The one read context: every file a load opens goes through a `CheckpointReadContext`.

It knows the checkpoint directory and its manifest, and does in one place what makes a load trustworthy:

* the directory is pinned for the whole load (opened once; on a local filesystem every file is opened relative
  to that directory descriptor), so a concurrent overwrite of the same id cannot mix two saves;
* containment: a path read from checkpoint data must be relative and stay inside; on a local filesystem no
  component may be a symlink, and the file must be a regular file (a FIFO would hang the load);
* the manifest: a file the manifest does not list is never read; a listed file is looked up by its path (so a
  file written once by the lowest rank is checked on every rank against that rank's record);
* verification: size always, CRC32 (the checksums the writer records) by default. A file read whole (decoded)
  is checked whole, off the caller's thread while decoding proceeds; a file read by byte ranges (a resharding
  source) is checked block by block: each ranged read fetches the checksummed blocks its range touches, checks
  those it has not checked before, and returns its slice. Files of manifests without block checksums are
  checked whole, as before.

Each checked file stays open (its descriptor held) until the context closes, so what was verified is what is
decoded, even if the directory is replaced meanwhile. Object stores have no descriptor to hold: there every
ranged read checks the bytes it returns (the blocks it fetched, or a few recently checked ones kept in memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import logging
import mmap
import os
import posixpath
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from torch_checkpointing.checksum import BlockChecksums, block_crc32s, combine_blocks, crc32, crc32_parallel
from torch_checkpointing.cold_read import (
    crc32_by_reads,
    is_cached,
    memory_file,
    private_copy,
    refuse_beyond_memory,
    seal,
)
from torch_checkpointing.errors import (
    CheckpointError,
    CheckpointReplacedError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ObjectStoreError,
    UnsafeCheckpointError,
    on_another,
    raise_if_short_of_resources,
    resource_shortage_named,
    unreadable_file,
)
from torch_checkpointing.futures import SettledFuture, WorkerPool, settle_all
from torch_checkpointing.manifest import (
    INCOMPLETE_MARKER,
    MANIFEST_FILE_NAME,
    DuplicateKeyError,
    FileRecord,
    Manifest,
    _BadConstant,
    check_json_tree,
    incomplete,
    odd_marker,
    parse_manifest,
    read_regular_file,
    read_stored_bounded,
    shown_name,
    stray_claim,
    unique_keys,
    what_to_pass_instead,
)
from torch_checkpointing.names import previous_copy_hint
from torch_checkpointing.storage.base_storage import ReadArgs, Storage
from torch_checkpointing.storage.fsspec_storage import new_bytes

__all__ = ["MAX_METADATA_BYTES", "CheckedFile", "CheckpointReadContext", "ReadPolicy", "checked_relative_path", "crc32"]

logger = logging.getLogger("torch_checkpointing.read_context")

T = TypeVar("T")

MAX_METADATA_BYTES = 256 * 1024 * 1024
_CHUNK_WORKERS = max(1, min(4, os.cpu_count() or 1))  # threads checking pieces of one file (and ranged blocks)
_COLD_READ_MIN_BYTES = 16 * 1024 * 1024  # smaller files: one mapping's readahead is as good
# What an operation that met its checkpoint replaced under it did not do (`CheckpointReadContext._replaced`).
_UNDONE = {"load": "nothing was restored", "export": "nothing was exported"}
_VERIFY_CHUNK = 16 * 1024 * 1024  # bytes read at a time when checking blocks nobody asked to keep
_KEPT_BLOCKS = 32  # checked blocks kept for the next ranged read (the ends of each range)
_KEPT_BYTES = 64 * 1024 * 1024  # and at most this much of them, beyond the last read's two ends
# Object stores: bytes a check phase fetched and checked (`verify_range`), kept for the copy phase's `read_range`
# of the same range so they are not fetched twice. Bounded: past it, the copy phase fetches (and checks) again.
PREFETCH_BUDGET_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class ReadPolicy:
    """What a load checks; built from `CheckpointLoaderConfig`."""

    verify_checksums: bool = True
    allow_legacy_checkpoints: bool = True


def checked_relative_path(path: Any, what: str) -> str:
    """The normalised form of a path read from checkpoint data, refused unless relative and inside."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise UnsafeCheckpointError(f"{what}: file path {path!r} is not a non-empty string.")
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:  # JSON's "\ud800": a bare UnicodeEncodeError from the open, naming nothing
        raise UnsafeCheckpointError(
            f"{what}: file path {path!r} holds {path[exc.start]!r}, a lone surrogate that no file name can hold; the "
            f"file is crafted or damaged."
        ) from None
    if posixpath.isabs(path) or path.startswith("\\") or (len(path) > 1 and path[1] == ":"):
        raise UnsafeCheckpointError(f"{what}: file path {path!r} is absolute; checkpoint paths must be relative.")
    normal = posixpath.normpath(path)
    if normal in (".", "..") or normal.startswith("../"):
        raise UnsafeCheckpointError(f"{what}: file path {path!r} leaves the checkpoint directory.")
    return normal


@dataclass
class CheckedFile:
    """One opened, contained, regular file.

    `verified` is the check of the whole file: asking for it starts it (once), and it resolves when every byte
    matched or fails naming the file. Ranged reads check blocks instead; `checked_blocks` marks those done.
    """

    rel: str
    size: int
    record: FileRecord | None
    fd: int | None = None
    data: bytes | None = None
    what: str = "file"
    error: CheckpointError | None = None  # a size mismatch, raised by every check() of the file
    checked_blocks: bytearray = field(default_factory=bytearray)
    lock: threading.Lock = field(default_factory=threading.Lock)
    fetch_lock: threading.Lock = field(default_factory=threading.Lock)
    random_access: bool = False  # readahead switched off for ranged reads
    cold: bool = False  # a large local file not in the page cache when its whole check started: checked by
    # reads, decoded after the check
    _whole: Future[None] | None = None
    _start_whole: Any = None  # called once to start the whole-file check; set by the context
    _copy_private: Any = None  # called once, before it, to read a local file into memory; set by the context
    start_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def verified(self) -> Future[None]:
        """Asking for it starts the whole check (once). A local file is first copied into memory on the asking
        thread (every other asker waits for the copy): whatever then reads it whole reads the copy."""
        with self.start_lock:
            with self.lock:
                if self._whole is not None:
                    return self._whole
            whole: Future[None] = SettledFuture()  # the load thread waits for it: see `futures`
            try:
                if self._copy_private is not None:
                    self._copy_private(self)
            except CheckpointError as exc:
                whole.set_exception(exc)
                self._whole = whole
                return whole
            with self.lock:
                self._whole = whole
                start = self._start_whole
            if start is None:
                whole.set_result(None)
            else:
                start(self, whole)
            return whole

    @property
    def whole_started(self) -> bool:
        return self._whole is not None

    def local_path(self) -> str | None:
        """The path of the held descriptor (`/proc/self/fd/N`) for callers that open or map the file by name;
        None where /proc does not name that very file now: they then read through the descriptor."""
        if self.fd is None:
            return None
        path = f"/proc/self/fd/{self.fd}"
        return path if _names_descriptor(path, self.fd) else None

    @property
    def blocks(self) -> BlockChecksums | None:
        return self.record.blocks if self.record is not None else None


def _names_descriptor(path: str, fd: int) -> bool:
    """Whether `path` opens the file `fd` holds, judged at each call. Judged once at import (a /proc directory
    there), a /proc unmounted or covered since (a sandbox hiding it) made every mapped load fail, calling an
    intact file "damaged or crafted"; and a /proc of another filesystem named whatever file it held there,
    which the load then decoded in place of the checked one."""
    try:
        named, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


class CheckpointReadContext:
    """Everything one load reads from one checkpoint directory. Use as a context manager."""

    def __init__(
        self, storage: Storage, checkpoint_id: str, policy: ReadPolicy, *, reads: bool = True, operation: str = "load"
    ) -> None:
        """`reads`: False for a look that only checks the files (a listing's `discovery.problem_with`), which
        holds one descriptor per file, not a load's two. `operation`: what reads the checkpoint ("load",
        "export", "check", "command"), as its errors name it: they told an export or a `verify` to retry the load."""
        self.reads = reads
        self.operation = operation
        self.storage = storage
        self.root = Path(checkpoint_id)
        self.shown = shown_name(storage, self.root)  # how messages name it: an object store's URL
        self.policy = policy
        self.manifest: Manifest | None = None
        # Which commit this load pinned: its manifest's bytes, hashed (None without a manifest). Ranks of one load
        # compare it: a replace between two ranks' opening the id gave them two commits, each whole on its own.
        self.commit_token: str | None = None
        self._dirfd: int | None = None
        self._reserved: int | None = None  # what `room_for_descriptors` reserved: `descriptors_released` on close
        self._entered = False  # once: see __enter__
        self._files: dict[str, CheckedFile] = {}
        self._originals: list[int] = []  # the files' own descriptors, where a copy in memory replaced them
        self._by_path: dict[str, FileRecord] = {}
        self._tasks = _Tasks(_VERIFY_POOL)
        self._chunk_tasks = _Tasks(_CHUNK_POOL)
        self._read_ahead = False
        self._metadata: Any = _UNSET
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._kept_lock = threading.Lock()
        self._prefetched: dict[tuple[str, int, int], bytes] = {}
        self._prefetched_bytes = 0

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> CheckpointReadContext:
        if self._entered:
            # Opening again would pin whatever the id holds by then under the records read the first time (a
            # re-save in between made `verify` check one commit's files against another's manifest), and drop
            # the first directory's descriptor.
            raise RuntimeError(f"The read context of {self.shown} is already open; open it once, then close it.")
        self._entered = True
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # Every check stopped first: none reads a descriptor or mapping released below. (A second Ctrl-C while
        # waiting leaves the descriptors open rather than closing them under a running check.)
        self._tasks.drain()  # before the chunk calls: a whole-file check waits for its own
        self._chunk_tasks.drain()
        for f in self._files.values():
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
        self._files.clear()
        while self._originals:
            os.close(self._originals.pop())
        if self._dirfd is not None:
            os.close(self._dirfd)
            self._dirfd = None
        if self._reserved is not None:
            reserved, self._reserved = self._reserved, None
            descriptors_released(reserved)

    def _open(self) -> None:
        local = self.storage.local_path(self.root)
        if local is not None:
            self._dirfd = self._open_directory(local)
        elif not self.storage.isdir(self.root):
            raise FileNotFoundError(f"Checkpoint path {self.shown} does not exist.")
        # Looked at first: a writer killed between writing the manifest and removing the marker leaves both.
        marked = self._exists(INCOMPLETE_MARKER)
        if not self._exists(MANIFEST_FILE_NAME):
            if marked:
                raise incomplete(self.root, self.storage, self.operation)
            self._no_manifest()
            return
        text = self._read_bounded(MANIFEST_FILE_NAME)
        self.manifest = parse_manifest(text, str(self.root / MANIFEST_FILE_NAME), self.operation)
        self.commit_token = hashlib.sha256(text).hexdigest()
        if marked and self._irregular(INCOMPLETE_MARKER):
            raise odd_marker(self.storage, self.root)
        if marked and not self._stray_claim(self.manifest):
            raise incomplete(self.root, self.storage, self.operation)
        where = str(self.root / MANIFEST_FILE_NAME)
        self._by_path = {checked_relative_path(r.path, where): r for r in self.manifest.files}
        if self._dirfd is not None:
            per_file = _DESCRIPTORS_PER_FILE if self.reads else 1  # a look holds only each file's own
            doing = f"loading {self.shown}" if self.reads else f"looking into {self.shown}"
            needed = per_file * (len(self._by_path) + 1)
            self._reserved = needed if room_for_descriptors(needed, doing) else None
        m = self.manifest
        if m.metadata_file is not None:
            name = checked_relative_path(m.metadata_file, f"{where}: field 'metadata_file'")
            self.manifest = m = dataclasses.replace(m, metadata_file=name)
            if m.metadata_size is not None and m.metadata_crc32 is not None:
                self._by_path[name] = FileRecord("<sharding metadata>", 0, name, m.metadata_size, m.metadata_crc32, {})

    def _open_directory(self, local: str, waited: bool = False) -> int:
        """The checkpoint's directory, held. An id that holds nothing while a live replace holds a copy of it
        aside (between its two renames) is opened once the new copy is in (`asides.await_replaced`)."""
        try:
            return os.open(local, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if waited:
                hint = previous_copy_hint(local)
                raise FileNotFoundError(f"Checkpoint path {self.shown} does not exist.{hint}") from None
        except NotADirectoryError:
            raise FileNotFoundError(f"Checkpoint path {self.shown} is not a directory.") from None
        except PermissionError as exc:  # searchable, not readable: unread, not damaged
            raise unreadable_file(self.shown, "the checkpoint's directory", exc) from exc
        from torch_checkpointing.asides import await_replaced  # it reads checkpoints through this module

        await_replaced(self.storage, self.root, self.shown)
        return self._open_directory(local, waited=True)

    def _stray_claim(self, manifest: Manifest) -> bool:
        """Whether the marker beside this manifest is another save's claim (see `manifest.stray_claim`)."""
        if manifest.claim is None:
            return False
        try:
            marker = self._read_bounded(INCOMPLETE_MARKER)
        except (OSError, CheckpointError):  # let go since it was seen, or no marker a save writes: incomplete
            return not self._exists(INCOMPLETE_MARKER)
        return stray_claim(marker, manifest)

    def _pinned_gone(self) -> bool:
        """Whether the directory this load pinned is no longer the one at its path (a save replaced the id, or a
        prune deleted it): then every file missing from it is that race, not damage. Removed (no link left), or
        still being removed: the path then names another directory (the new save's) or nothing (a deletion moved
        it to the trash). Before, only the first counted: a file gone while the replacer was still removing the
        old copy was "listed in the manifest but missing: the checkpoint was damaged"."""
        if self._dirfd is None:
            return False
        pinned = os.fstat(self._dirfd)
        if pinned.st_nlink == 0:
            return True
        local = self.storage.local_path(self.root)
        try:
            now = os.stat(local) if local is not None else None
        except FileNotFoundError:
            return True
        except OSError:  # cannot tell (a permission changed meanwhile): what is missing is reported as found
            return False
        return now is not None and (now.st_dev, now.st_ino) != (pinned.st_dev, pinned.st_ino)

    def _replaced(self) -> CheckpointReplacedError:
        return CheckpointReplacedError(
            f"Checkpoint {self.shown} was replaced or deleted while this {self.operation} ran (the directory it "
            f"opened is gone); {_UNDONE.get(self.operation, 'nothing read from it was used')}. Retry the "
            f"{self.operation}."
        )

    def _verification_asked(self) -> str:
        """Who asked for a manifest: a load by its policy; any other reader always does (a `damage()` check was
        told "this load asked for verification (verify_checksums=True ...)", though it loaded nothing)."""
        if self.operation == "load":
            return "this load asked for verification (verify_checksums=True or allow_legacy_checkpoints=False)"
        return f"this {self.operation} reads only checkpoints whose manifest vouches for them"

    def _no_manifest(self) -> None:
        if self._pinned_gone():
            # Its manifest is gone with it, which is no legacy checkpoint. Taken for one, a load with only
            # optional items returned {} and restored nothing.
            raise self._replaced()
        if hint := what_to_pass_instead(self.storage, self.root):  # a run's root, a killed save's temporary
            raise IncompleteCheckpointError(f"{self.shown}: no {MANIFEST_FILE_NAME}: not a checkpoint.{hint}")
        if not self.storage.atomic_rename:
            # Object stores (issue 14): the manifest, written last, IS the commit. Files without one are a save
            # still running or one that died; the published release never wrote to such a store.
            raise IncompleteCheckpointError(
                f"Checkpoint {self.shown} has no {MANIFEST_FILE_NAME}: on this store (no atomic rename) the manifest "
                f"is written last and is the commit, so this is a save that is still running or never finished. "
                f"{on_another(self.operation)}"
            )
        if not self.policy.allow_legacy_checkpoints:
            trusted = " Or, if you trust this one, load it with the defaults (unverified, with a warning)."
            raise IncompleteCheckpointError(
                f"Checkpoint {self.shown} has no {MANIFEST_FILE_NAME}, so nothing says its save committed and "
                f"nothing can be verified (its manifest was removed, or it was written without one by the "
                f"published release), and {self._verification_asked()}. "
                f"{on_another(self.operation, 'an intact checkpoint')}{trusted if self.operation == 'load' else ''}"
            )
        logger.warning(
            "Loading %s without a manifest (allow_legacy_checkpoints=True): files are checked for containment "
            "and type only; their contents cannot be verified.",
            self.shown,
        )

    def _at(self, rel: str) -> str:
        """A file of this checkpoint as messages name it (under an object store's URL)."""
        return f"{self.shown}/{rel}" if self.storage.local_path(self.root) is None else str(self.root / rel)

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
        """Open a file the checkpoint holds and check containment, type and size; its checksums are checked as
        it is read (whole, or block by block for ranged reads).

        `what` says who wants the file (an item key, the sharding metadata) for the error message.
        """
        rel = checked_relative_path(rel_path, f"{what} in checkpoint {self.shown}")
        with self._lock:
            checked = self._files.get(rel)
            if checked is None:
                record = self.record(rel)
                if self.manifest is not None and record is None and rel != self.manifest.metadata_file:
                    raise UnsafeCheckpointError(
                        f"File {self._at(rel)} ({what}) is not listed in the checkpoint's manifest; an unlisted "
                        f"file is never read. {on_another(self.operation, 'an untouched copy of the checkpoint')}"
                    )
                checked = self._open_file(rel, record, what)
                self._prepare(checked, what)
                self._files[rel] = checked
        if checked.error is not None:
            raise checked.error
        return checked

    def start_whole(self, rel_path: str, what: str, private: bool = False) -> None:
        """Start checking a file that will be read whole, before the first read asks for it.

        `private`: what is decoded from it is returned as it is (no template to copy into), so it is decoded from
        a copy in memory (`_copy_private`), never from a mapping of the checkpoint's file. Loads into templates
        copy out of the mapping instead: a copy of every file would cost its size in memory and, measured on a
        256 MiB warm load, 7x the time."""
        checked = self.check(rel_path, what)
        if private:
            checked._copy_private = self._copy_private
        _ = checked.verified

    def wait_verified(self) -> None:
        """Block until every file read whole is verified; raise the first failure (in path order).

        Files read only by byte ranges (resharding sources) are not waited for: each ranged read checked the
        blocks it returned before returning them.
        """
        for rel in sorted(self._files):
            checked = self._files[rel]
            if checked.whole_started:
                checked.verified.result()

    def _prepare(self, checked: CheckedFile, what: str) -> None:
        record = checked.record
        if record is not None and checked.size != record.size:
            # Known without reading a byte; kept, so a later check() of the same file raises it again.
            checked.error = CorruptCheckpointError(
                f"File {self._at(checked.rel)} ({what}) has {checked.size} bytes but the manifest records "
                f"{record.size}: the checkpoint was modified or damaged after it was committed."
            )
            return
        if record is None or not self.policy.verify_checksums:
            return  # nothing to verify against: `verified` resolves at once
        checked.what = what
        checked._start_whole = self._start_whole
        if record.blocks is not None:
            checked.checked_blocks = bytearray(record.blocks.block_count())

    def _open_file(self, rel: str, record: FileRecord | None, what: str) -> CheckedFile:
        if self._dirfd is None:
            path = self.root / rel
            # The size from one HEAD; the bytes on demand: a resharding read then fetches only the blocks its
            # byte ranges touch (issue 14), a whole read the object once.
            with self._vanishing(rel, what):
                if not self.storage.exists(path):
                    raise self._missing(rel, what)
                return CheckedFile(rel, self.storage.getsize(path), record)
        fd = self._open_contained(rel, what)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeCheckpointError(
                    f"File {self._at(rel)} ({what}) is not a regular file (mode {stat.filemode(st.st_mode)}); "
                    f"a checkpoint holds only regular files. "
                    f"{on_another(self.operation, 'an untouched copy of the checkpoint')}"
                )
        except BaseException:
            os.close(fd)
            raise
        return CheckedFile(rel, st.st_size, record, fd=fd)

    def _copy_private(self, checked: CheckedFile) -> None:
        """Swap a local file's descriptor for one of its copy in memory, before anything reads it whole: the check
        and every whole read then see the same bytes, and what a load returns never maps the checkpoint's file
        (`cold_read.private_copy`). The file's own descriptor stays held until the context closes."""
        fd = checked.fd
        if fd is None:
            return
        checked.cold = checked.size >= _COLD_READ_MIN_BYTES and not is_cached(fd, checked.size)
        if checked.cold and checked._start_whole is not None:
            return  # copied by its check's reads, in one pass over the disk (`_file_crc32`)
        what = checked.what
        self._refuse_beyond_memory(checked)
        with self._vanishing(checked.rel, what):
            copy = private_copy(fd, checked.size, lambda at: self._shrank(checked, at, what))
        self._use_copy(checked, copy)

    def _refuse_beyond_memory(self, checked: CheckedFile) -> None:
        """`cold_read.refuse_beyond_memory` for the copy of a file (`_copy_private`): a checkpoint without a
        manifest holding a sparse 1 TiB file (no record to vouch for its size) was copied until the machine ran
        out. A small file's copy is not looked at."""
        if checked.size >= _COLD_READ_MIN_BYTES:
            refuse_beyond_memory(checked.size, f"{self._at(checked.rel)} ({checked.what})", f"the {self.operation}")

    def _use_copy(self, checked: CheckedFile, copy: int | None) -> None:
        if copy is not None:
            assert checked.fd is not None
            self._originals.append(checked.fd)
            checked.fd = copy

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
                            f"File {self._at(rel)} ({what}) is reached through a symbolic link or a non-directory "
                            f"({exc.strerror}); checkpoint files must be regular files inside the directory."
                        ) from None
                    if isinstance(exc, PermissionError):
                        raise unreadable_file(self._at("/".join(parts[: i + 1])), what, exc) from exc
                    raise_if_short_of_resources(exc, self._at(rel), what)
                    raise CorruptCheckpointError(f"Cannot open {self._at(rel)} ({what}): {exc}") from exc
                if current != self._dirfd:
                    os.close(current)
                current = fd
            return current
        except BaseException:
            if current != self._dirfd:
                os.close(current)
            raise

    def _missing(self, rel: str, what: str) -> CheckpointError:
        if self._pinned_gone():
            return self._replaced()
        if self.manifest is not None:
            return CorruptCheckpointError(
                f"File {self._at(rel)} ({what}) is listed in the checkpoint's manifest but missing: the checkpoint "
                f"was damaged, or replaced or deleted while this {self.operation} ran (retry the {self.operation} "
                f"if another process overwrote it)."
            )
        return CorruptCheckpointError(f"File {self._at(rel)} ({what}) does not exist.")

    @contextlib.contextmanager
    def _vanishing(self, rel: str, what: str) -> Iterator[None]:
        """A call to the storage for file `rel`. On a store without a held descriptor, a file can go between the
        listing and the read (another process deleted or replaced the checkpoint): that is the checkpoint's
        state, not a caller's bug. Any other failure (a storage plugin's own exception, a network error) is the
        storage's, not the file's: before, it came out bare, naming no file, or a decoder called the intact file
        "damaged or crafted"; it is an `ObjectStoreError` naming the file and the storage."""
        try:
            yield
        except FileNotFoundError:
            raise self._missing(rel, what) from None
        except (CheckpointError, MemoryError):
            raise
        except Exception as exc:
            raise_if_short_of_resources(exc, self._at(rel), what)  # this process's shortage, not the storage's
            raise ObjectStoreError(
                f"Reading {self._at(rel)} ({what}) through the storage {type(self.storage).__name__} failed "
                f"({type(exc).__name__}: {exc}); the checkpoint was not found damaged. Retry the {self.operation} "
                f"once the storage works."
            ) from exc

    def _start_whole(self, checked: CheckedFile, outer: Future[None]) -> None:
        """Check the whole file on the verify pool (decoding proceeds meanwhile); `outer` gets the outcome."""
        fd = checked.fd  # asked here, not at open: a file read only by ranges is never checked whole
        checked.cold = fd is not None and checked.size >= _COLD_READ_MIN_BYTES and not is_cached(fd, checked.size)
        assert checked.record is not None
        inner = self._tasks.submit(self._verify, checked, checked.record, checked.what)
        inner.add_done_callback(lambda f: _forward(f, outer))

    def _crc32(self, view: memoryview) -> int:
        """A whole file's CRC32, a large one split across the cores (the biggest file bounds the check phase)."""
        return crc32_parallel(view, self._chunk_tasks, _CHUNK_WORKERS)

    def _verify(self, checked: CheckedFile, record: FileRecord, what: str) -> None:
        """Check every byte of a file against its record: one whole-file CRC32 (native calls release the GIL for
        the whole pass; a call per block waits for the GIL 4096 times a GiB while the loader decodes), and, with
        block CRCs, the manifest's own consistency: they must combine to its whole-file CRC. Only on a mismatch
        are the blocks checked one by one, to name the damaged one. This process short of memory or descriptors
        (the map of the file refused) names the file and says it is no damage: it was a bare "[Errno 12]"."""
        with resource_shortage_named(self._at(checked.rel), what):
            self._check_crc32s(checked, record, what)

    def _check_crc32s(self, checked: CheckedFile, record: FileRecord, what: str) -> None:
        blocks = record.blocks
        if blocks is not None:
            recorded = combine_blocks(blocks.crc32s, checked.size, blocks.block_size)
            if recorded != record.crc32:
                raise CorruptCheckpointError(
                    f"File {self._at(checked.rel)} ({what}): its manifest record is inconsistent (the block "
                    f"CRC32s combine to {recorded:#010x}, the file's CRC32 is recorded as {record.crc32:#010x}): "
                    f"the manifest is damaged. {on_another(self.operation)}"
                )
        actual = self._file_crc32(checked, what)
        if actual != record.crc32:
            if blocks is not None:
                self._name_damaged_block(checked, blocks, what)
            raise CorruptCheckpointError(
                f"File {self._at(checked.rel)} ({what}) fails its CRC32 check (manifest {record.crc32:#010x}, "
                f"file {actual:#010x}): the checkpoint is damaged. {on_another(self.operation)}"
            )
        if blocks is not None:
            with checked.lock:
                checked.checked_blocks[:] = b"\x01" * len(checked.checked_blocks)

    def _file_crc32(self, checked: CheckedFile, what: str) -> int:
        """A whole file's CRC32: read in large `pread`s when a local file is not in the page cache (`cold_read`),
        else through a mapping (or the fetched bytes of an object store's file)."""
        fd = checked.fd
        if fd is not None and checked.cold:
            if checked._copy_private is not None:
                self._refuse_beyond_memory(checked)
            copy = memory_file(checked.size) if checked._copy_private is not None else None  # `start_whole`
            try:
                short = lambda at: self._shrank(checked, at, what)  # noqa: E731
                crc = crc32_by_reads(fd, checked.size, self._chunk_tasks, _CHUNK_WORKERS, short, copy)
                if copy is not None:
                    seal(copy)
            except BaseException:
                if copy is not None:
                    os.close(copy)
                raise
            self._use_copy(checked, copy)
            return crc
        with self._whole_view(checked) as view:
            return self._crc32(view)

    def _shrank(self, checked: CheckedFile, at: int, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"File {self._at(checked.rel)} ({what}) ends at byte {at} while this {self.operation} read it, but its "
            f"size was "
            f"{checked.size}: another process truncated it. {on_another(self.operation)} Retry if another process "
            f"overwrote it."
        )

    def _name_damaged_block(self, checked: CheckedFile, blocks: BlockChecksums, what: str) -> None:
        """Raise the error naming the first block whose CRC32 differs from its record (if one still does)."""
        with self._whole_view(checked) as view:
            actual = block_crc32s(view, blocks.block_size)
        for i, (want, got) in enumerate(zip(blocks.crc32s, actual, strict=True)):
            if want != got:
                raise self._block_error(checked, i, want, got, what)

    def _block_error(self, checked: CheckedFile, index: int, want: int, got: int, what: str) -> CorruptCheckpointError:
        blocks = checked.blocks
        assert blocks is not None
        start, end = blocks.span(index, checked.size)
        return CorruptCheckpointError(
            f"File {self._at(checked.rel)} ({what}) fails its CRC32 check in block {index} of "
            f"{blocks.block_count()} (bytes [{start}, {end})): manifest {want:#010x}, file {got:#010x}. The "
            f"checkpoint is damaged. {on_another(self.operation)}"
        )

    @contextlib.contextmanager
    def _whole_view(self, checked: CheckedFile) -> Iterator[memoryview]:
        """Every byte of a file: the fetched object, or a read-only map of the held descriptor."""
        if checked.fd is None:
            yield memoryview(self._whole_data(checked))
            return
        if checked.size == 0:
            yield memoryview(b"")
            return
        with mmap.mmap(checked.fd, checked.size, prot=mmap.PROT_READ) as mapped:
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                mapped.madvise(mmap.MADV_SEQUENTIAL)  # read once, front to back: full readahead when cold
            view = memoryview(mapped)
            try:
                yield view
            finally:
                view.release()

    def _whole_data(self, checked: CheckedFile) -> bytes:
        """An object store's file, fetched once and kept: what is verified is what is decoded."""
        with checked.fetch_lock:
            if checked.data is None:
                with self._vanishing(checked.rel, checked.what):
                    data = self.storage.read(self.root / checked.rel)
                if len(data) != checked.size:
                    raise CorruptCheckpointError(
                        f"File {self._at(checked.rel)} changed size while it was read ({checked.size} bytes, then "
                        f"{len(data)}): it was replaced during the {self.operation}. Retry the {self.operation}."
                    )
                checked.data = data
            return checked.data

    # ------------------------------------------------------------------ block checks for ranged reads

    def _ranged(self, checked: CheckedFile) -> bool:
        """Whether reads of this file are checked by block (else: whole, or not at all)."""
        return checked._start_whole is not None and checked.blocks is not None and not self._read_ahead

    def _checked_range(self, checked: CheckedFile, offset: int, length: int, keep: bool) -> bytes | None:
        """Check every block that [offset, offset+length) touches; return the range's bytes when `keep`."""
        if checked.fd is None:
            return self._checked_range_kept(checked, offset, length, self._fetch_remote(checked))
        _read_exactly(checked)
        if keep:
            # Bytes kept are checked as they are read, even where a check phase checked their blocks: bytes read
            # again from the file are not the ones checked (the file may have been written into since).
            return self._checked_range_kept(checked, offset, length, self._fetch_local(checked))
        blocks = checked.blocks
        assert blocks is not None
        first, last = offset // blocks.block_size, (offset + length - 1) // blocks.block_size
        with checked.lock:
            todo = [i for i in range(first, last + 1) if not checked.checked_blocks[i]]
        if todo:
            self._check_local_blocks(checked, todo)
        return None

    def _fetch_local(self, checked: CheckedFile) -> Callable[[int, int], memoryview]:
        fd = checked.fd
        assert fd is not None
        return lambda lo, hi: memoryview(_pread_buffer(fd, lo, hi - lo, self._at(checked.rel)))

    def _fetch_remote(self, checked: CheckedFile) -> Callable[[int, int], memoryview]:
        def fetch(lo: int, hi: int) -> memoryview:
            with self._vanishing(checked.rel, checked.what):
                view = memoryview(self.storage.read_range(self.root / checked.rel, lo, hi - lo))
            if len(view) != hi - lo:
                raise CorruptCheckpointError(
                    f"File {self._at(checked.rel)} returned {len(view)} bytes for [{lo}, {hi}); it was replaced "
                    f"or truncated during the {self.operation}. Retry the {self.operation}."
                )
            return view

        return fetch

    def _check_local_blocks(self, checked: CheckedFile, todo: list[int]) -> None:
        """Check blocks of a local file without keeping their bytes, reading a bounded run at a time."""
        blocks = checked.blocks
        assert blocks is not None and checked.fd is not None
        for run in _runs(todo, max(1, _VERIFY_CHUNK // blocks.block_size)):
            lo, hi = blocks.span(run[0], checked.size)[0], blocks.span(run[-1], checked.size)[1]
            data = _pread_buffer(checked.fd, lo, hi - lo, self._at(checked.rel))
            self._check_blocks(checked, memoryview(data), lo, run)

    def _check_blocks(self, checked: CheckedFile, view: memoryview, view_start: int, indices: list[int]) -> None:
        """Compare the CRC32 of each listed block (whose bytes `view` holds from `view_start`) with the manifest."""
        blocks = checked.blocks
        assert blocks is not None

        def one(i: int) -> int:
            start, end = blocks.span(i, checked.size)
            return crc32(view[start - view_start : end - view_start])

        large = len(indices) * blocks.block_size > 2 * _VERIFY_CHUNK
        actual = list(self._chunk_tasks.map(one, indices)) if large else [one(i) for i in indices]
        for i, got in zip(indices, actual, strict=True):
            if got != blocks.crc32s[i]:
                raise self._block_error(checked, i, blocks.crc32s[i], got, checked.what)
        with checked.lock:
            for i in indices:
                checked.checked_blocks[i] = 1

    def _checked_range_kept(
        self, checked: CheckedFile, offset: int, length: int, fetch: Callable[[int, int], memoryview]
    ) -> bytes:
        """Fetch the blocks the range touches (one read per run of blocks not kept from an earlier read), check
        them, and return the range. Nothing unchecked is returned: bytes fetched now are checked now, whatever
        a check phase found before (an object store's object, a local file read again). The end blocks are kept
        (`_keep`): a read of each of many small tensors fetched and checked its whole blocks again, a local source
        of 100 KB tensors in 256 KiB blocks was read about seven times its size."""
        blocks = checked.blocks
        assert blocks is not None
        bs = blocks.block_size
        first, last = offset // bs, (offset + length - 1) // bs
        pieces: dict[int, memoryview] = {}
        with self._kept_lock:
            for i in {first, last}:
                kept = self._kept.get((checked.rel, i))
                if kept is not None:
                    self._kept.move_to_end((checked.rel, i))
                    pieces[i] = memoryview(kept)
        missing = [i for i in range(first, last + 1) if i not in pieces]
        for run in _runs(missing):
            lo, hi = blocks.span(run[0], checked.size)[0], blocks.span(run[-1], checked.size)[1]
            view = fetch(lo, hi)
            self._check_blocks(checked, view, lo, run)
            if len(run) == last - first + 1:  # one fetch covers the range: slice it, no joining
                self._keep(checked.rel, {i: view[blocks.span(i, checked.size)[0] - lo :][:bs] for i in {first, last}})
                return bytes(view[offset - lo : offset - lo + length])
            for i in run:
                start = blocks.span(i, checked.size)[0] - lo
                pieces[i] = view[start : start + bs]
        self._keep(checked.rel, {i: pieces[i] for i in {first, last}})
        begin = offset - first * bs
        return b"".join(pieces[i] for i in range(first, last + 1))[begin : begin + length]

    def _keep(self, rel: str, pieces: dict[int, memoryview]) -> None:
        """Keep the end blocks of a ranged read: the next read often starts or ends in the same block."""
        with self._kept_lock:
            for i, piece in pieces.items():
                if (rel, i) not in self._kept:
                    self._kept[(rel, i)] = bytes(piece)
                self._kept.move_to_end((rel, i))
            while len(self._kept) > 2 and (
                len(self._kept) > _KEPT_BLOCKS or sum(map(len, self._kept.values())) > _KEPT_BYTES
            ):
                self._kept.popitem(last=False)

    # ------------------------------------------------------------------ reading checked files

    @contextlib.contextmanager
    def reading_ahead(self) -> Iterator[None]:
        """Within this block reads of a file in the page cache do not wait for its checksum (a cold file's do).

        For the loader's decode step only: it overlaps decoding with verification of the whole file and uses
        nothing it decoded before `wait_verified()` has returned. Every other read (a resharder's) is checked
        before it returns: whole reads against the whole file, ranged reads against the blocks they touch.
        """
        self._read_ahead = True
        try:
            yield
        finally:
            self._read_ahead = False

    def _checked_whole(self, rel_path: str, what: str) -> CheckedFile:
        """A file about to be used whole: its whole check started (and, outside read-ahead or for a cold file,
        passed)."""
        checked = self.check(rel_path, what)
        verified = checked.verified
        if not self._read_ahead or checked.cold or verified.done():
            # A cold file is decoded after its check has read it into the page cache: a decoder's small reads
            # (the pickle, the zip directory, one header per record) would each wait for the disk, and seek the
            # check's sequential reads away.
            verified.result()
        return checked

    def read_bytes(self, rel_path: str, what: str = "file") -> bytes:
        checked = self.check(rel_path, what)
        if checked.fd is None:
            if checked._start_whole is None:  # nothing to verify: fetched now, as it is
                with self._vanishing(checked.rel, what):
                    return self.storage.read(self.root / checked.rel)
            data = self._whole_data(checked)
            self._checked_whole(rel_path, what)
            return data
        self._checked_whole(rel_path, what)
        return _pread_all(checked.fd, 0, checked.size, self._at(checked.rel))

    def read_range(self, rel_path: str, offset: int, length: int, what: str = "file") -> bytes:
        checked = self._ranged_file(rel_path, offset, length, what)
        if length == 0:
            return b""
        if self._ranged(checked) and not self._whole_passed(checked):
            data = self._take_prefetched(checked, offset, length)
            if data is None:
                data = self._checked_range(checked, offset, length, keep=True)
            assert data is not None
            return data
        if checked._start_whole is not None:  # no block checksums (an older manifest), or read-ahead
            self._checked_whole(rel_path, what)
        if checked.data is not None:
            return checked.data[offset : offset + length]
        if checked.fd is None:
            if checked._start_whole is not None:
                return self._whole_data(checked)[offset : offset + length]
            with self._vanishing(checked.rel, what):  # unverified: just these bytes
                return self.storage.read_range(self.root / checked.rel, offset, length)
        return _pread_all(checked.fd, offset, length, self._at(checked.rel))

    def verify_range(self, rel_path: str, offset: int, length: int, what: str = "file") -> None:
        """Check bytes [offset, offset+length) before a caller uses them through `mapped_path` (a memory map)."""
        checked = self._ranged_file(rel_path, offset, length, what)
        if length == 0 or checked._start_whole is None:
            return
        if self._ranged(checked):
            if not self._whole_passed(checked):
                data = self._checked_range(checked, offset, length, keep=False)
                if data is not None:  # an object store: the bytes were fetched to check them
                    self._keep_prefetched(checked, offset, data)
            return
        self._checked_whole(rel_path, what)

    def _keep_prefetched(self, checked: CheckedFile, offset: int, data: bytes) -> None:
        with self._kept_lock:
            key = (checked.rel, offset, len(data))
            if key not in self._prefetched and self._prefetched_bytes + len(data) <= PREFETCH_BUDGET_BYTES:
                self._prefetched[key] = data
                self._prefetched_bytes += len(data)

    def _take_prefetched(self, checked: CheckedFile, offset: int, length: int) -> bytes | None:
        with self._kept_lock:
            data = self._prefetched.pop((checked.rel, offset, length), None)
            if data is not None:
                self._prefetched_bytes -= len(data)
            return data

    def _ranged_file(self, rel_path: str, offset: int, length: int, what: str) -> CheckedFile:
        checked = self.check(rel_path, what)
        if offset < 0 or length < 0 or offset + length > checked.size:
            raise CorruptCheckpointError(
                f"Read of bytes [{offset}, {offset + length}) of {self._at(checked.rel)} ({what}) lies outside "
                f"its {checked.size} bytes: the file's header is damaged."
            )
        return checked

    @staticmethod
    def _whole_passed(checked: CheckedFile) -> bool:
        whole = checked._whole
        return whole is not None and whole.done() and whole.exception() is None

    def local_path(self, rel_path: str, what: str = "file") -> str | None:
        """A path to the whole file, for callers that may read any byte of it: the whole file is checked."""
        return self._checked_whole(rel_path, what).local_path()

    def mapped_path(self, rel_path: str, what: str = "file") -> str | None:
        """A path for a caller that maps the file and calls `verify_range` for every byte range before using
        it (the resharder's block reads): no whole-file check. None on object stores."""
        checked = self.check(rel_path, what)
        if self._read_ahead or (checked._start_whole is not None and checked.blocks is None):
            self._checked_whole(rel_path, what)
        return checked.local_path()

    def _exists(self, rel: str) -> bool:
        if self._dirfd is None:
            return self.storage.exists(self.root / rel)
        try:
            os.stat(rel, dir_fd=self._dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def _irregular(self, rel: str) -> bool:
        """Whether the root's `rel` is no regular file (a link, a FIFO, a directory): never one the engine wrote.
        Looked at in the pinned directory where there is one."""
        if self._dirfd is None:
            return self.storage.is_irregular(self.root / rel)
        try:
            return not stat.S_ISREG(os.stat(rel, dir_fd=self._dirfd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def _read_bounded(self, rel: str) -> bytes:
        """Read a root file that no manifest can vouch for (the manifest itself), bounded, regular only."""
        if self._dirfd is None:
            with self._vanishing(rel, "manifest"):
                return read_stored_bounded(self.storage, self.root / rel)
        fd = self._open_contained(rel, "manifest")
        try:
            return read_regular_file(fd, self.root / rel)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ the storage view

    def storage_view(self, what: str | None = None) -> Storage:
        """A read-only `Storage` whose every read goes through this context (for resharders and decoders);
        `what` says in errors who reads through it (an item key), else each file's path is all they say."""
        return _ContextStorage(self, what)

    def relative(self, path: Path | str) -> str:
        """`path` (under the checkpoint as the caller named it) relative to the checkpoint directory."""
        p = Path(path)
        try:
            rel = p.relative_to(self.root)
        except ValueError:
            raise UnsafeCheckpointError(
                f"Path {p} lies outside the checkpoint {self.shown} being read; a {self.operation} reads only its "
                f"own files."
            ) from None
        return checked_relative_path(rel.as_posix(), f"path {p}")


_DESCRIPTORS_PER_FILE = 2  # a local file's own, held to the end, and its copy in memory (`_copy_private`)
_DESCRIPTORS_SPARE = 64  # what the rest of the load (a writer's pipe, torch's own opens) and the caller may use


def room_for_descriptors(needed: int, doing: str) -> bool:
    """Raise this process's soft limit of open files (RLIMIT_NOFILE), never past the hard one, so that `needed`
    more can be open at once beside those open now and those the other loads in flight reserved, for `doing`
    ("loading <checkpoint>"); logged at INFO when raised. Returns whether the caller is now counted among the
    loads in flight: it calls `descriptors_released(needed)` once its files are closed.

    Raised to the next power of two: raised to the count alone, each later load or listing with a few more
    descriptors open (a job's sockets, its logs) raised it again, and said so at INFO every time. A listing holds
    one descriptor per file it checks (`CheckpointReadContext(reads=False)`), and raised the limit for two where
    one fitted.

    A load holds every local file it reads open until it ends, and a save opens one at a time: a checkpoint of
    1100 items, saved under the common soft limit of 1024, could not be loaded by the process that saved it
    ("[Errno 24] Too many open files") where the hard limit allowed far more. Where the hard limit is too low
    too, the opens past it fail naming the file and the fix (`errors.raise_if_short_of_resources`).

    The descriptors open now are always counted: a process holding 930 of its 1024 (sockets, logs, pipes) could
    not load 80 files, because files needing less than half the soft limit were taken to fit. Under a lock, so
    that of two loads at once the one wanting less never lowers the limit the other has just raised. What the
    other loads in flight reserved is counted too: they open their files later, and of two loads on two threads
    (150 and 90 files under a soft limit of 256) the second found room beside the first's few descriptors open
    so far, and then one of them failed with EMFILE."""
    try:
        import resource
    except ImportError:  # no POSIX limits (Windows)
        return False
    with _LIMIT_LOCK:
        _RAISED.holders += 1
        _RAISED.reserved += needed
    try:
        raised = _raised_to_fit(resource, doing)
        if raised is not None:
            logger.info(
                "Raised this process's soft limit of open files (RLIMIT_NOFILE) from %d to %d (hard limit %s): %s "
                "holds each of its files open until it ends; it is put back once no load is in flight.",
                *raised,
                doing,
            )
    except BaseException:
        # Counted, yet the caller never learns it is (a Ctrl-C as the raise was logged): before, the count was
        # left for the process's life, the limit never put back, and every later load reserved beside it.
        descriptors_released(needed)
        raise
    return True


def _raised_to_fit(resource: Any, doing: str) -> tuple[int, int, int | str] | None:
    """Raise the soft limit to fit the descriptors open and those the loads in flight reserved (see
    `room_for_descriptors`); (from, to, hard limit as told) where it was raised, else None."""
    with _LIMIT_LOCK:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return None
        # Those open already are counted twice where a load in flight opened them: room to spare, never short.
        wanted = _descriptors_open(soft) + _RAISED.reserved + _DESCRIPTORS_SPARE
        if wanted <= soft:
            return None
        wanted = 1 << (wanted - 1).bit_length()
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if raised <= soft:
            return None
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        except (OSError, ValueError) as exc:
            logger.debug("Could not raise the soft limit of open files to %d for %s: %s", raised, doing, exc)
            return None
        if _RAISED.before is None or soft != _RAISED.ours:  # the job's own limit, set while a load was in flight
            _RAISED.before = soft
        _RAISED.ours = raised
    return soft, raised, "unlimited" if hard == resource.RLIM_INFINITY else hard


def descriptors_released(needed: int) -> None:
    """The end of a load counted by `room_for_descriptors`. The last load in flight puts the soft limit back to
    what it was before loads raised it, or to what the descriptors open now need where they are more.

    Before, the limit stayed raised for the process's life: a job's own lower soft limit (its guard against a
    descriptor leak, the limit its children inherit) was gone after its first large load, and said only at INFO.
    Not at the end of each load: another load in flight on another thread holds its files open under the raised
    limit, and its next open failed with EMFILE. Left alone where something else set the limit since; where a
    later load raised it again past what the job set meanwhile, put back to the job's (before, to the limit from
    before the first load, below the job's own)."""
    import resource

    with _LIMIT_LOCK:
        _RAISED.holders -= 1
        _RAISED.reserved -= needed
        before, ours = _RAISED.before, _RAISED.ours
        if _RAISED.holders > 0 or before is None:
            return
        _RAISED.before = None
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        back = min(ours, max(before, _descriptors_open(before) + _DESCRIPTORS_SPARE))
        if soft != ours or back >= soft:  # set by someone else since: theirs to keep
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (back, hard))
        except (OSError, ValueError) as exc:
            logger.debug("Could not put the soft limit of open files back to %d: %s", back, exc)
            return
    logger.info(
        "Put this process's soft limit of open files (RLIMIT_NOFILE) back from %d to %d: no load is in flight.",
        ours,
        back,
    )


@dataclass
class _Raised:
    """The loads in flight (`holders`) and the descriptors they reserved (`reserved`), and the soft limit before
    they raised it (`before`, None if they did not) and what they raised it to (`ours`)."""

    holders: int = 0
    reserved: int = 0
    before: int | None = None
    ours: int = 0


_RAISED = _Raised()
_LIMIT_LOCK = threading.Lock()  # `room_for_descriptors`: one reads and raises the limit at a time


def _descriptors_open(soft: int) -> int:
    """How many descriptors this process has open (Linux's /proc/self/fd); half the soft limit where that
    cannot be told (macOS, /proc not mounted)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return soft // 2


def parse_json_bounded(data: bytes, where: str, max_depth: int = 64) -> Any:
    """JSON from checkpoint data: UTF-8, no NaN/Infinity, nesting bounded; errors name the file and field."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_BadConstant, object_pairs_hook=unique_keys)
    except DuplicateKeyError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}.") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({type(exc).__name__}: {exc}).") from None
    check_json_tree(value, where, max_depth)
    return value


def _pread_all(fd: int, offset: int, length: int, where: str = "File") -> bytes:
    """Bytes [offset, offset+length) of `fd`, read straight into the `bytes` returned (`new_bytes`), read after
    read. Before, every read went through a buffer copied into `bytes`: a raw item (returned as the file's bytes)
    cost twice its size, and a checkpoint without a manifest holding a sparse file of N bytes (no disk used) cost
    2N of memory; then one read into the result held only up to the 2 GiB one read(2) gives on Linux, and a
    longer file was joined from that read and a buffer of the rest into a third object, twice the file again."""
    if length <= _ONE_READ:  # one read gives it all, into the bytes it returns (a file cut short reads on)
        data = os.pread(fd, length, offset)
        if len(data) == length:
            return data
    out, view = new_bytes(length)
    _pread_into(fd, view, offset, where)
    return out if isinstance(out, bytes) else bytes(out)


_ONE_READ = 0x7FFFF000
"""The most bytes one read(2) gives on Linux, whatever is asked for."""


def _pread_buffer(fd: int, offset: int, length: int, where: str = "File") -> bytearray:
    buf = bytearray(length)
    _pread_into(fd, memoryview(buf), offset, where)
    return buf


def _pread_into(fd: int, view: memoryview, offset: int, where: str) -> None:
    """Fill `view` from `fd` at `offset`; a file that ends first was cut short meanwhile (`_cut_short`)."""
    length, done = len(view), 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise _cut_short(where, offset + done, offset + length)
        done += n


def _cut_short(where: str, ended: int, expected: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where} ended after {ended} bytes; expected {expected}: another process truncated it while it was "
        f"read. Use an earlier checkpoint, or retry if another process overwrote it."
    )


def _read_exactly(checked: CheckedFile) -> None:
    """Ranged reads of a held file fetch what they ask for: no kernel readahead past the blocks (it can be
    megabytes, and would be charged to a resharding load as bytes read)."""
    if not checked.random_access and checked.fd is not None and hasattr(os, "posix_fadvise"):
        checked.random_access = True
        os.posix_fadvise(checked.fd, 0, 0, os.POSIX_FADV_RANDOM)


def _runs(indices: list[int], longest: int | None = None) -> Iterator[list[int]]:
    """Consecutive runs of sorted block indices, each at most `longest` long: [1, 2, 3, 7, 8] -> [1, 2, 3], [7, 8]."""
    run: list[int] = []
    for i in indices:
        if run and (i != run[-1] + 1 or len(run) == longest):
            yield run
            run = []
        run.append(i)
    if run:
        yield run


class _Tasks(Executor):
    """One load's calls on a process-wide pool (threads start once per process, not once per load).

    `drain()`, at the load's close, waits for every call made through it (one may still read a descriptor or a
    mapping the close releases next) and turns those not started yet into CancelledError: a failed load does not
    wait for the checks of files it will never read.
    """

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        self._futures: list[Future[Any]] = []
        self._draining = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future = self._pool.submit(self._unless_draining, fn, args, kwargs)
        self._futures.append(future)
        return future

    def _unless_draining(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        if self._draining:
            raise CancelledError()
        return fn(*args, **kwargs)

    def drain(self) -> None:
        self._draining = True
        done = 0
        while done < len(self._futures):  # a running check may still add calls
            settle_all(self._futures[done : done + 1])
            done += 1
        self._futures.clear()


# Separate pools: a whole-file check waits for its chunk calls, which in its own pool could deadlock.
_VERIFY_POOL = WorkerPool(max(2, min(8, os.cpu_count() or 2)), "ckpt-verify")
_CHUNK_POOL = WorkerPool(_CHUNK_WORKERS, "ckpt-verify-crc")


def _forward(inner: Future[None], outer: Future[None]) -> None:
    exc = inner.exception()
    if exc is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(None)


_UNSET: Any = object()


class _ContextStorage(Storage):
    """A read-only Storage over one read context: the seam that keeps `Resharder.load(..., storage)` working."""

    def __init__(self, ctx: CheckpointReadContext, what: str | None = None) -> None:
        self._ctx = ctx
        self._what_for = what

    def _rel(self, path: Path) -> str:
        return self._ctx.relative(path)

    def _what(self, path: Path) -> str:
        # Errors name the file themselves (by its URL): `str(path)` repeated it, in the spelling `Path` folds
        # a URL into (`s3:/bucket/key`).
        return self._what_for or "file"

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        return io.BytesIO(self.read(path))  # type: ignore[return-value]

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        return self._ctx.read_bytes(self._rel(path), self._what(path))

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        return self._ctx.read_range(self._rel(path), offset, length, self._what(path))

    def local_path(self, path: Path) -> str | None:
        return self._ctx.local_path(self._rel(path), self._what(path))

    def mapped_path(self, path: Path) -> str | None:
        return self._ctx.mapped_path(self._rel(path), self._what(path))

    def verify_range(self, path: Path, offset: int, length: int) -> None:
        self._ctx.verify_range(self._rel(path), offset, length, self._what(path))

    def exists(self, path: Path) -> bool:
        return self._ctx.lists(self._rel(path))

    def getsize(self, path: Path) -> int:
        return self._ctx.check(self._rel(path), self._what(path)).size

    def isdir(self, path: Path) -> bool:
        return Path(path) == self._ctx.root or self._ctx.storage.isdir(path)

    def ls(self, path: Path) -> list[str]:
        prefix = "" if Path(path) == self._ctx.root else self._rel(path) + "/"
        names = {p[len(prefix) :].split("/")[0] for p in self._ctx._by_path if p.startswith(prefix)}
        return sorted(names)

    def remap_path(self, path: Path) -> str:
        return self._ctx.storage.remap_path(path)

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError("A load's storage view is read-only; resharders must not write to the checkpoint.")

    stream_write = write = delete = mkdir = rmdir = rename = _read_only
