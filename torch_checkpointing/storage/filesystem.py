"""Local filesystem storage: durable writes (fsync), optional O_DIRECT, atomic directory exchange."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import io
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_checkpointing.config import check_bool, recheck
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
from torch_checkpointing.storage.direct_io import DurableFileWriter

__all__ = ["LocalFileSystemStorage", "LocalFileSystemStorageConfig", "WriteStream"]

WriteStream = DurableFileWriter
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV}
_log = logging.getLogger("torch_checkpointing.storage")


@dataclass
class LocalFileSystemStorageConfig(StorageConfig):
    """A local (or mounted) filesystem; `use_direct_io` writes with O_DIRECT, falling back when refused."""

    use_direct_io: bool = True

    def __post_init__(self) -> None:
        check_bool("LocalFileSystemStorageConfig", "use_direct_io", self.use_direct_io)

    def create_storage(self) -> LocalFileSystemStorage:
        recheck(self)  # a field set since construction
        return LocalFileSystemStorage(config=self)


def cannot_look_into(path: str | os.PathLike[str], exc: OSError) -> PermissionError:
    """The refusal of a lookup of `path` that a directory on its way denies: which directory, and the fix."""
    closed = _closed_directory(os.fspath(path))
    return PermissionError(
        exc.errno,
        f"Cannot tell whether {os.fspath(path)} is there: {exc.strerror} looking into {closed}. Give this user read "
        f"and search permission on {closed} (chmod u+rx, or a group that has them), or run as its owner",
    )


def cannot_list(path: str | os.PathLike[str], exc: OSError) -> PermissionError:
    """The refusal of a listing of the directory `path` (a run's root, a checkpoint): which directory, and the
    fix. Before, the OS's bare "[Errno 13] Permission denied: 'run'" from `ls`, `gc`, `prune` and
    `latest_checkpoint`, which named no fix (and, for a directory above it, not the one that is closed)."""
    closed = os.fspath(path) if _reached(os.fspath(path)) else _closed_directory(os.fspath(path))
    return PermissionError(
        exc.errno,
        f"Cannot list {os.fspath(path)}: {exc.strerror} on {closed}; this user may not read it, which says nothing "
        f"about what it holds. Give this user read and search permission on {closed} (chmod u+rx, or a group that "
        f"has them), or run as its owner",
    )


def _reached(path: str) -> bool:
    """Whether a lookup of `path`'s own entry passes every directory on its way (a refusal of it is its own)."""
    try:
        os.lstat(path)
    except PermissionError:
        return False
    except OSError:  # missing, or a name too long: no directory on the way refused it
        return True
    return True


def _closed_directory(path: str) -> str:
    """The first directory on the way to `path` (outermost first) in which a lookup is refused, found by the
    lookups themselves; its parent when none is (the refusal is of `path` itself: an ACL, a security module).

    Not by `os.access` and `os.path.isdir`: `os.access` says yes to root for every directory, though /proc, a
    security module or a FUSE mount still refuse root, and a link that cannot be followed (`/proc/<pid>/root` of
    a process this one may not trace) is no `isdir`, so the message named a directory below the closed one.
    """
    parent = os.path.dirname(path) or "."
    ancestors = [os.fspath(p) for p in reversed(Path(parent).parents)] + [parent]
    for directory, step in zip(ancestors, [*ancestors[1:], path], strict=True):
        try:
            os.lstat(step)  # its own entry: a link on the way is followed by the next step's lookup
        except PermissionError:
            return directory
        except OSError:  # missing, or no directory: nothing further down was refused
            return parent
    return parent


def _renameat2() -> Any | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    func = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None)
    if func is not None:
        func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        func.restype = ctypes.c_int
    return func


def raise_unless_removed(exc: OSError) -> None:
    """`os.walk`'s onerror: a directory removed meanwhile is skipped; one that cannot be listed raises.

    `os.walk` drops such a directory in silence by default: what was in it went unseen, as if not there."""
    if not isinstance(exc, FileNotFoundError):
        raise exc


def remove_tree_marks_last(local: str) -> None:
    """Remove the directory `local`: everything below it bottom-up, then its manifest, marker and itself.

    Symbolic links below it are unlinked, never followed; `local` itself must not be one. A directory that cannot
    be listed raises before anything in it is removed (it looked empty: its marks went, leaving a folder gc no
    longer knows as ours).
    """
    if os.path.islink(local):
        raise OSError(errno.ENOTDIR, "Refusing to remove a symbolic link as a directory", local)
    marks = [os.path.join(local, MANIFEST_FILE_NAME), os.path.join(local, INCOMPLETE_MARKER)]
    for dirpath, dirnames, filenames in os.walk(local, topdown=False, onerror=raise_unless_removed):
        for name in filenames + dirnames:
            full = os.path.join(dirpath, name)
            if full in marks:
                continue
            if stat.S_ISDIR(os.lstat(full).st_mode):
                os.rmdir(full)
            else:
                os.unlink(full)
    for mark in marks:  # the manifest before the marker: a directory holding both then holds the marker alone
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mark)
    os.rmdir(local)


class LocalFileSystemStorage(Storage):
    def __init__(self, config: LocalFileSystemStorageConfig | None) -> None:
        if not isinstance(config, LocalFileSystemStorageConfig):  # None: the ValueError API_SURFACE §7.2 records
            error = ConfigError if config is None else ConfigTypeError
            raise error(
                f"LocalFileSystemStorage needs a LocalFileSystemStorageConfig (got {config!r}); e.g. "
                f"LocalFileSystemStorageConfig(use_direct_io=False)."
            )
        self.config = config

    def _check_parent(self, path: Path) -> None:
        parent = os.path.dirname(os.fspath(path)) or "."
        if not os.path.isdir(parent):
            # RuntimeError, not a CheckpointError: the type recorded in API_SURFACE §7.2, which callers catch
            raise RuntimeError(f"Parent directory does not exist, create it!: {parent}")

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        args = read_args or ReadArgs()
        if args.pre_read_full_file:
            with open(path, "rb") as f:
                return io.BytesIO(f.read())  # type: ignore[return-value]
        return open(path, "rb", buffering=0)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def local_path(self, path: Path) -> str | None:
        return os.fspath(path)

    def stream_write(self, path: Path) -> DurableFileWriter:
        self._check_parent(path)
        return DurableFileWriter(os.fspath(path), self.config.use_direct_io)

    def write(self, path: Path, data: Any) -> None:
        with self.stream_write(path) as stream:
            stream.write(data)

    def delete(self, path: Path) -> None:
        os.remove(path)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """Create `path` (and, if `recursive`, its missing parents), each new entry durable on return.

        A directory's entry lives in its parent, so every parent that gained an entry is fsync'd: without it
        a power cut after the commit could lose `runs/` of `runs/exp1/step_1` and with it the checkpoint.
        """
        missing: list[str] = []
        current = os.path.abspath(os.fspath(path))
        while not os.path.isdir(current):
            missing.append(current)
            parent = os.path.dirname(current)
            if parent == current or not recursive:
                break
            current = parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise
            self.sync_directory(Path(os.path.dirname(directory)))

    def rmdir(self, path: Path) -> None:
        """Remove a directory and everything below it, its manifest and `.incomplete` marker last.

        Those two are what tell gc a directory is ours (`discovery._marked`), so a removal killed at any point
        leaves a directory gc still recognises (a `.tmp-`, `.old_` or trash name is collected later), never an
        anonymous half that looks like a user's folder; one at a checkpoint's own name keeps its manifest, whose
        missing files make a load refuse it. (shutil.rmtree removed them in whatever order the directory listed.)
        """
        try:
            os.rmdir(path)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        remove_tree_marks_last(os.fspath(path))

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        is_cross_link: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        if is_cross_link:
            shutil.move(os.fspath(src_path), os.fspath(dst_path))
        else:
            os.rename(src_path, dst_path)

    def ls(self, path: Path) -> list[str]:
        try:
            return os.listdir(path)
        except PermissionError as exc:
            raise cannot_list(path, exc) from None

    def exists(self, path: Path) -> bool:
        """Whether `path` is there (following links, as `os.path.exists`). A directory on the way that this user
        may not look into is no answer: PermissionError naming it, where `os.path.exists` said False, and an
        unreadable checkpoint read as "no manifest.json: not a checkpoint" (a resume went back a step silently)."""
        try:
            os.stat(path)
        except PermissionError as exc:
            raise cannot_look_into(path, exc) from None
        except (OSError, ValueError):  # missing, a dangling link or a link loop, a name too long
            return False
        return True

    def getsize(self, path: Path) -> int:
        return os.path.getsize(path)

    def isdir(self, path: Path) -> bool:
        return os.path.isdir(path)

    def remap_path(self, path: Path) -> str:
        return os.fspath(path)

    def sync_directory(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace_directory(self, src: Path, dst: Path) -> None:
        """Swap `src` into `dst` in one atomic step (renameat2 RENAME_EXCHANGE) when replacing."""
        func = _renameat2() if os.path.isdir(dst) else None
        if func is None or func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_EXCHANGE) != 0:
            err = ctypes.get_errno() if func is not None else 0
            if err == errno.ENOENT and os.path.isdir(src) and not os.path.lexists(dst):
                # Another process deleted the replaced checkpoint (prune, a retention pass) since the check: the
                # id is empty, so moving in is the whole replace. It failed the save with this ENOENT.
                self.rename(src, dst, is_directory=True)
                return
            if err and err not in _NO_EXCHANGE:
                raise OSError(err, f"{os.strerror(err)} (swapping {src} into place)", os.fspath(dst))
            super().replace_directory(src, dst)  # this filesystem or kernel has no atomic exchange
            return
        try:
            self.rmdir(src)  # `src` now holds the replaced checkpoint
        except OSError as exc:  # the new checkpoint is committed; only the old copy is left behind
            _log.warning(
                "Checkpoint %s is committed, but its replaced copy %s could not be removed (%s); "
                "`torch-checkpointing gc %s` removes it once this process is gone, or delete it by hand.",
                dst,
                src,
                exc,
                os.path.dirname(os.path.abspath(dst)),
            )
