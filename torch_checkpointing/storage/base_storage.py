"""The storage interface: everything the engine reads or writes goes through it.

Kept small on purpose (the planner/storage split of torch.distributed.checkpoint):
a backend only moves bytes and names; layouts, formats and resharding live elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import io
import logging
import os
import stat
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from typing_extensions import Buffer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

from torch_checkpointing.names import aside_name, holding, host_tag, new_nonce

_log = logging.getLogger("torch_checkpointing.storage")


def named_at(path: str | os.PathLike[str]) -> float:
    """When `path` last changed, its rename to a hidden name included: a rename sets the ctime, not the mtime,
    and a directory moved aside a moment ago kept the mtime of when it was written (days ago, for a checkpoint
    that retention deletes). OSError when it cannot be looked at."""
    st = os.lstat(path)
    return max(st.st_mtime, st.st_ctime)


# How long one reading of a store's clock (`store_now`) stands for it, advanced by this host's monotonic clock: one
# probe per folder and process at most this often (a gc or retention pass reads it once), and a store's clock
# drifts from this host's by microseconds, not seconds, over it.
STORE_CLOCK_REREAD_S = 30.0
# where: (its clock minus monotonic(), None where no probe could be written there; monotonic() when read)
_store_clocks: dict[str, tuple[float | None, float]] = {}
_store_clocks_lock = threading.Lock()
_no_probe_told: set[str] = set()


_probes_running: set[str] = set()  # names of this process's probes being written now (`probing`)
# Set by `writing_nothing`: a pass that promises to change nothing (a dry run) reads clocks without a probe.
_writing_nothing: contextvars.ContextVar[bool] = contextvars.ContextVar("store_clock_writing_nothing", default=False)
_dry_fallback_told: set[str] = set()


@contextlib.contextmanager
def writing_nothing() -> Iterator[None]:
    """Within it (in this thread), `store_now` writes no probe: a dry run of gc or retention, or `ls`, must leave
    the store as it found it. Before, `gc --dry-run` wrote (and removed) a
    `.clock-probe-` object or file in the root, and one killed in between was left there."""
    token = _writing_nothing.set(True)
    try:
        yield
    finally:
        _writing_nothing.reset(token)


def clock_probe_name() -> str:
    """The hidden name of this process's probe of a store's clock (`store_now`, `CLOCK_PROBE_RE`): no
    checkpoint, leftover or claim of ours is so named, and listings pass over names that start with a dot."""
    return f".clock-probe-{os.getpid()}-{new_nonce()}-{host_tag()}"


@contextlib.contextmanager
def probing(name: str) -> Iterator[None]:
    """Mark the probe `name` (its base name) as being written by this process, for `clock_probe_running`."""
    with _store_clocks_lock:
        _probes_running.add(name)
    try:
        yield
    finally:
        with _store_clocks_lock:
            _probes_running.discard(name)


def clock_probe_running(name: str) -> bool:
    """Whether this process is writing the probe `name` now: one with its pid that it is not writing was left
    by a killed process that had the pid before (a job restarted in a container gets the dead one's pid)."""
    with _store_clocks_lock:
        return name in _probes_running


def store_now(where: str, probe: Callable[[], float | None], look: Callable[[], float | None] | None = None) -> float:
    """Now on the clock of the store that stamps what is at `where` (an NFS server's, an object store's), read
    from `probe` (the stamp of something it writes there and removes) at most once per `STORE_CLOCK_REREAD_S`.

    Every age the engine judges a stamp of the store by (gc's `unowned_after_s`, a copy aside "moved a moment
    ago", a process "started after" a name was made) is this minus that stamp: before, this host's clock minus
    the store's stamp, and a host ahead of its file server by more than a margin took a live replace's copy aside
    for a dead one's (gc put the old copy back under it) and another host's live temporary for an old one
    (removed). Where no probe can be written (no write access: a reader of a read-only mount), this host's clock,
    said once per place at INFO (and tried again after `STORE_CLOCK_REREAD_S`, not at every age: on an object
    store each try is a request).

    Within `writing_nothing`, `look` reads the clock instead (a reading that writes nothing: an S3 answer's `Date`,
    an unnamed file), or, with none or where it fails, this host's clock, said once per place at INFO and never
    kept for the passes that may write."""
    with _store_clocks_lock:
        known = _store_clocks.get(where)
    if known is not None and time.monotonic() - known[1] < STORE_CLOCK_REREAD_S:
        return time.time() if known[0] is None else known[0] + time.monotonic()
    if _writing_nothing.get():
        return _read_without_probe(where, look)
    stamp = probe()
    # Taken once the probe is done: its stamp was made no later than now, so a probe held up (a stalled file
    # server, a retried PUT) makes ages young by that much, never old. Taken before it, the stamp counted from
    # the probe's start, and "now" read late by the whole stall for the period it stands.
    read_at = time.monotonic()
    if stamp is None:
        with _store_clocks_lock:
            _store_clocks[where] = (None, read_at)
        _say_once(
            _no_probe_told,
            where,
            "The clock of the store at %s cannot be read (no probe written); ages there are measured by this host's "
            "clock",
        )
        return time.time()
    with _store_clocks_lock:
        _store_clocks[where] = (stamp - read_at, read_at)
    return stamp + (time.monotonic() - read_at)


def _read_without_probe(where: str, look: Callable[[], float | None] | None) -> float:
    """`store_now` within `writing_nothing`: `look`'s reading (kept, as a probe's is: it is the store's clock), or
    this host's clock (not kept: a pass that may write probes for the store's own)."""
    stamp = look() if look is not None else None
    read_at = time.monotonic()
    if stamp is None:
        _say_once(
            _dry_fallback_told,
            where,
            "The clock of the store at %s cannot be read without writing there, which this pass does not do (a dry "
            "run); ages there are measured by this host's clock",
        )
        return time.time()
    with _store_clocks_lock:
        _store_clocks[where] = (stamp - read_at, read_at)
    return stamp


def _say_once(told: set[str], where: str, message: str) -> None:
    """`message` (its one `%s`: `where`) at INFO, the first time only for `where` among `told`."""
    if where not in told:
        told.add(where)
        _log.info(message, where)


def local_store_now(folder: str | os.PathLike[str]) -> float:
    """`store_now` of a local folder (an NFS mount: the server stamps ctime), probed with a file made there (within
    `writing_nothing`, an unnamed one only)."""
    where = os.path.abspath(folder)
    return store_now(where, lambda: _probe_file_ctime(where), lambda: _probe_unnamed(where))


def _probe_file_ctime(folder: str) -> float | None:
    """The ctime (set by the filesystem's clock, never by a caller) of a file made in `folder` and removed at
    once: an unnamed one where the filesystem has O_TMPFILE (nothing is ever seen, even after a kill), else a
    hidden name (NFS); None where neither can be made."""
    unnamed = _probe_unnamed(folder)
    if unnamed is not None:
        return unnamed
    base = clock_probe_name()
    with probing(base):
        return _probe_named(os.path.join(folder, base))


def _probe_unnamed(folder: str) -> float | None:
    """The ctime of an O_TMPFILE file made in `folder`, which no name ever shows; None without O_TMPFILE (NFS)."""
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except (OSError, AttributeError):
        return None
    try:
        return os.fstat(fd).st_ctime
    finally:
        os.close(fd)


def _probe_named(name: str) -> float | None:
    """The ctime of the empty file `name`, made and removed (one a kill leaves there is gc's: `CLOCK_PROBE_RE`)."""
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        _log.debug("No clock probe could be made at %s: %s", name, exc)
        return None
    try:
        return os.fstat(fd).st_ctime
    finally:
        os.close(fd)
        try:
            os.unlink(name)
        except FileNotFoundError:  # removed already, by another host's gc that took it for a killed prober's
            _log.debug("The clock probe %s was removed by another process before this one removed it", name)
        except OSError as exc:
            _log.warning(
                "Could not remove the clock probe %s (%s): an empty file; `torch-checkpointing gc` removes it once "
                "this process is gone, or delete it by hand",
                name,
                exc,
            )


@dataclass
class ReadArgs:
    pre_read_full_file: bool = True
    direct_io: bool = False
    timeout_us: int = 900_000_000


@dataclass
class StorageConfig(ABC):
    """Picklable description of a store; `create_storage()` builds the `Storage` (in the writer process too)."""

    # Whether an id of this store can live in one process alone (fsspec's `memory://`, `Storage.process_local`).
    # Told from the class so that an async save asks a built storage only where it can be so: the trainer
    # builds no storage of its own otherwise (one that cannot be built there, e.g. credentials only the writer
    # holds, failed every save).
    may_be_process_local: ClassVar[bool] = False

    @abstractmethod
    def create_storage(self) -> Storage:
        """Build the `Storage` this config describes (the async writer process builds its own from a copy)."""


class Storage(ABC):
    """Where checkpoint files live: streams, whole-file writes, listing, and the commit's directory swap.

    What the engine calls, and when (paths are `Path`s the engine built from the checkpoint id):

    * save, in the process that writes (the trainer for sync saves; the writer process, which builds its
      own storage with `StorageConfig.create_storage()`, for async ones): rank 0 first checks the target
      (`exists`, `isdir`, `ls`, `read_sized` of an existing manifest); every rank then `mkdir`s the save's
      temporary directory (with `atomic_rename=False`: the final one) and the item files' directories,
      writes each item file through `stream_write` (closing it makes the bytes durable) and calls
      `sync_directory`; rank 0 writes the small files (`write`: the `.incomplete` marker, `metadata.json`,
      `manifest.json`), `delete`s the marker and moves the directory into place with `replace_directory`
      (whose default uses `exists`, `rename(is_directory=True)` and `rmdir`). A failed save is removed
      with `rmdir`.
    * load, on every rank: `exists`, `isdir`, `read_sized` (the manifest: `local_path` first, and a local one
      is opened directly), `read` (metadata), `getsize`, then per file either
      `local_path` (mapped) or `read`/`stream_read`; resharding sources are read with `read_range`, or
      mapped through `mapped_path` with `verify_range` before each block is used.
    * discovery, retention and the CLI: `ls`, `isdir`, `exists`, `rename(is_directory=True)` into a trash
      name and `rmdir`; `handles_url` when a manager picks its storage from a checkpoint id.
    * `remap_path` names a path in messages (an object store's URL), and, on a store whose `local_path` is
      None, tells retention which listed checkpoints the ids a caller protects name: two paths of one
      checkpoint must map to one name.

    What a subclass that overrides a read (to count, route or decrypt) can rely on: every byte the engine reads
    comes from `read` (a whole file), `read_range` (a part) or `stream_read`, and the size of a file it reads
    from `getsize` (or `read_sized`). `read_sized` is `getsize`, then `read_range(path, 0, size)`; a backend
    answers it in one request of its own (FsspecStorage on S3: one version of the object) only while it owns
    those two, so a subclass that overrides either is called for every manifest (of a store whose `local_path`
    is None: a local one is opened directly). The defaults derive
    `read_range` from `read` and `read` from `stream_read`; a backend that fetches them otherwise (FsspecStorage:
    ranged GETs) needs all three overridden by a subclass that changes the bytes.

    Never called by the engine: `glob`, and `rename`'s `is_cross_link` and `background_cleanup` (always
    False); they are kept for code written against the published release.
    """

    # Whether `replace_directory` can swap a whole directory into place atomically. Stores that cannot
    # rename a directory (object stores) set this False: the commit then writes files under the final
    # name and the manifest last, and a prefix without a manifest is an incomplete checkpoint.
    atomic_rename: bool = True

    @abstractmethod
    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        """A readable binary stream of the file at `path`; FileNotFoundError when there is none."""

    @abstractmethod
    def stream_write(self, path: Path) -> io.IOBase:
        """A writable binary stream; closing it must make the bytes durable (fsync)."""

    @abstractmethod
    def write(self, path: Path, data: Buffer) -> None:
        """Write `data` (any buffer) to `path` durably (fsync before returning)."""

    @abstractmethod
    def delete(self, path: Path) -> None:
        """Remove the file at `path`."""

    @abstractmethod
    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """Create the directory `path` (with `recursive`, its missing parents too); one already there is no error.
        An object store may do nothing: a prefix is there once an object is under it."""

    @abstractmethod
    def rmdir(self, path: Path) -> None:
        """Remove a directory and everything below it."""

    @abstractmethod
    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        is_cross_link: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        """Move `src_path` to `dst_path` (a directory and everything below it when `is_directory`). Atomic where
        `atomic_rename` is True; an object store copies, then deletes. `is_cross_link` and `background_cleanup`
        are the published release's: the engine passes False."""

    @abstractmethod
    def ls(self, path: Path) -> list[str]:
        """The names (not paths) of the entries directly under the directory `path`."""

    @abstractmethod
    def exists(self, path: Path) -> bool:
        """Whether a file or a directory is at `path`."""

    @abstractmethod
    def getsize(self, path: Path) -> int:
        """The size in bytes of the file at `path`; FileNotFoundError when there is none."""

    @abstractmethod
    def isdir(self, path: Path) -> bool:
        """Whether `path` is a directory (on an object store: a prefix with objects under it); False when nothing
        is there."""

    def remap_path(self, path: Path) -> str:
        """The backend's own name for `path` (a URL for object stores): in messages, and, where `local_path` is
        None, how retention matches the ids it must keep to the checkpoints it lists (see the class docstring)."""
        return str(path)

    # ---- concrete helpers; backends may override them for speed or atomicity ----

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        """The whole file's bytes, through `stream_read`; backends override it to read in one request."""
        with self.stream_read(path, read_args) as stream:
            return stream.read()

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of a file; backends override to avoid reading the rest."""
        return self.read(path)[offset : offset + length]

    def read_sized(self, path: Path, limit: int) -> tuple[int, bytes | None]:
        """The size of the file at `path` and, when it is at most `limit` bytes, all of its bytes (None when larger:
        nothing read): `getsize`, then `read_range`. A backend whose file can be replaced between a size and a read
        overrides it to take both from one version (S3: one GET, sized by its own answer): else a replace in
        between read the first bytes of the new version as the whole of the old. Such an override stands for that
        pair: it calls them where a subclass overrides either (see the class docstring)."""
        size = self.getsize(path)
        if size > limit:
            return size, None
        return size, self.read_range(path, 0, size) if size else b""

    def tree_bytes(self, path: Path) -> int:
        """The bytes of every file under the directory `path` (what removing it frees), links not followed; 0
        when nothing is there. Backends override it with one listing."""
        if self.is_link(path) or not self.isdir(path):
            return self.getsize(path) if self.exists(path) and not self.is_link(path) else 0
        return sum(self.tree_bytes(path / name) for name in self.ls(path))

    def local_path(self, path: Path) -> str | None:
        """A path the OS can open (for mmap), or None when the backend is not a local filesystem."""
        return None

    def is_link(self, path: Path) -> bool:
        """Whether `path` is a symbolic link: an entry a cleanup removes at most, never walks into (through one,
        a name under a checkpoint reaches a user's files anywhere). False where there are no links (object
        stores) or nothing is there."""
        local = self.local_path(path)
        return local is not None and os.path.islink(local)

    def process_local(self, path: Path) -> bool:
        """Whether what is written at `path` lives in this process alone (fsspec's `memory://`): another process
        (the async saver's writer) that writes there writes into a store of its own, which nobody here sees."""
        return False

    def changed_at(self, path: Path) -> float | None:
        """When what is at `path` (a hidden copy gc may collect: a trash, an aside) got its name or last changed,
        by the store's clock (`store_now` tells its age); None where that cannot be told (it then counts as made
        just now, kept). FileNotFoundError when nothing is there."""
        local = self.local_path(path)
        return None if local is None else named_at(local)

    def store_now(self, folder: Path) -> float:
        """Now by the clock that stamps what `changed_at` reads under `folder` (`base_storage.store_now`); this
        host's clock where the store says no time of its own."""
        local = self.local_path(folder)
        return time.time() if local is None else local_store_now(local)

    def is_irregular(self, path: Path) -> bool:
        """Whether what is at `path` is no regular file (a link, a FIFO, a directory, a device): never a file the
        engine wrote (its manifest, its `.incomplete` marker), however it reads. False where nothing is there
        and on an object store, whose objects are all plain bytes."""
        local = self.local_path(path)
        if local is None:
            return False
        try:
            return not stat.S_ISREG(os.lstat(local).st_mode)
        except FileNotFoundError:
            return False

    def mapped_path(self, path: Path) -> str | None:
        """A path for a caller that maps the file and calls `verify_range` for each byte range before using it.

        A load's verifying view hands it out without checking the whole file first (a resharding source is
        checked block by block); plain stores have nothing to check, so it is `local_path`.
        """
        return self.local_path(path)

    def verify_range(self, path: Path, offset: int, length: int) -> None:  # noqa: B027 - a no-op by design
        """Raise unless bytes [offset, offset+length) of `path` match the checksums the checkpoint recorded.

        For bytes read through `mapped_path`; a no-op on plain stores, which record no checksums.
        """

    def handles_url(self, checkpoint_id: str) -> bool:
        """Whether this store takes URL-looking ids (`s3://bucket/run`); local stores refuse them (a `./s3:` dir)."""
        return False

    def sync_directory(self, path: Path) -> None:  # noqa: B027 - a no-op by design, not an abstract method
        """Make directory entries below `path` durable; a no-op where the backend has no such notion."""

    def replace_directory(self, src: Path, dst: Path) -> None:
        """Move the complete directory `src` to `dst`, replacing any `dst` only once `src` is in place.

        The fallback renames the old `dst` aside first (`names.aside_name`: pid and nonce, cut to fit NAME_MAX),
        so a crash between the two renames leaves the old checkpoint intact beside its id, never damaged: gc
        (`retention.collect_garbage`) moves it back under the id once its process is gone. Backends with an atomic
        exchange override it.
        """
        if not self.exists(dst):
            self.rename(src, dst, is_directory=True)
            return
        aside = dst.with_name(aside_name(dst.name, os.getpid(), new_nonce(), host_tag()))
        with holding(aside):  # this process's pid may be a killed one's: gc here must not take it for that one's
            try:
                self.rename(dst, aside, is_directory=True)
            except FileNotFoundError:
                if self.exists(dst):
                    raise
                # Another process deleted it since the check (prune, a retention pass): the id is empty, so
                # moving in is the whole replace. This failed the save.
                self.rename(src, dst, is_directory=True)
                return
            try:
                self.rename(src, dst, is_directory=True)
            except BaseException:
                # A signal handler can raise once the rename is done: `dst` is then the new checkpoint, and
                # putting the old one back would fail (and say so wrongly).
                if self._moved(src, dst):
                    _log.warning(
                        "Checkpoint %s was moved into place, but the replace was interrupted right after; the "
                        "replaced copy is left at %s (gc removes it once this process is gone).",
                        dst,
                        aside,
                    )
                else:
                    self._put_back(aside, dst)
                raise
            self._remove_replaced(aside, dst)

    def _moved(self, src: Path, dst: Path) -> bool:
        """Whether a rename of `src` to `dst` took effect (asked after it raised)."""
        try:
            return not self.exists(src) and self.exists(dst)
        except Exception:
            return False

    def _remove_replaced(self, aside: Path, dst: Path) -> None:
        try:
            self.rmdir(aside)
        except OSError as exc:  # `dst` is committed; failing the save now would report a checkpoint that exists
            _log.warning(
                "Checkpoint %s is committed, but its replaced copy %s could not be removed (%s); "
                "`torch-checkpointing gc %s` removes it once this process is gone, or delete it by hand.",
                dst,
                aside,
                exc,
                dst.parent,
            )

    def _put_back(self, aside: Path, dst: Path) -> None:
        """Move the displaced checkpoint back under its id after a failed swap; a failure here is a WARNING.

        The swap's own error is the one the caller raises; if this rename fails too, the old checkpoint is
        intact but hidden at `aside`, and only this message says where it is and how to get it back.
        """
        try:
            self.rename(aside, dst, is_directory=True)
        except Exception as exc:
            _log.warning(
                "Checkpoint %s could not be put back under its id after a failed replace: it is intact at %s, but "
                "moving it back failed (%s). Remove whatever is at %s now, then rename %s to %s (gc does that "
                "once nothing is at the id and this process is gone).",
                dst,
                aside,
                exc,
                dst,
                aside,
                dst,
            )

    def glob(self, pattern: str) -> list[str]:
        """Full paths in `pattern`'s directory whose names match it (one level); kept for old code, unused here."""
        directory, name_pattern = os.path.split(pattern)
        try:
            names = self.ls(Path(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [os.path.join(directory, n) for n in names if fnmatch.fnmatch(n, name_pattern)]
