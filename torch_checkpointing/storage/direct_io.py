"""A write stream that uses O_DIRECT where the filesystem allows it and buffered I/O where it does not.

O_DIRECT needs block-aligned buffers, offsets and lengths, and some filesystems refuse it outright (tmpfs at
open) or only later (EINVAL on the first unaligned write, or at fsync/close). Any such refusal switches the
stream to buffered I/O at the current offset and the write goes on: a checkpoint never fails because of a
tuning flag. Closing the stream fsyncs it, so a closed file is durable.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import threading
from concurrent.futures import Future

from torch_checkpointing.checksum import FileChecksum, RunningChecksum
from torch_checkpointing.futures import WorkerPool

ALIGN = 4096
CHUNK = 16 << 20
_REFUSALS = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EFAULT}


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


class DurableFileWriter(io.RawIOBase):
    """Sequential writer of one file; `close()` flushes, fsyncs and closes.

    In direct mode two aligned buffers alternate: while one is written by an I/O thread and checksummed by
    another (both release the GIL), the caller fills the other, so encoding, checksumming and the disk overlap.
    `checksum()` (and `crc32`, `size`) describe every byte written, for the manifest: each block is checksummed
    once, in file order, on the checksum thread in direct mode.

    The first OSError (ENOSPC, EFBIG, EIO...) is kept, named with the file's path, and raised again by every
    later call, close() included: an encoder that turns a failed write into its own error (torch's
    "unexpected pos") cannot hide it, because the stream's close() at the end of the `with` raises it.
    The descriptor is closed exactly once, whatever fails: a second close of a reused descriptor number would
    write into, or close, some unrelated file of the process.
    """

    def __init__(self, path: str, use_direct_io: bool) -> None:
        super().__init__()
        self._path = path
        self._offset = 0  # bytes confirmed written so far
        self._direct = use_direct_io and hasattr(os, "O_DIRECT")
        self._error: OSError | None = None
        self._finished = False  # set first thing in close(), before anything that can raise
        self._buf: mmap.mmap | None = None
        self._spare: mmap.mmap | None = None
        self._fill = 0
        self._pending: list[Future[None]] = []  # write and checksum of the spare buffer
        self._checksum_state = RunningChecksum()
        self.size = 0
        self._fd = -1
        try:
            self._fd = self._open()
            st = os.fstat(self._fd)
            # The file this stream created, (st_dev, st_ino): a failed save's cleanup removes only that file,
            # never one another program put at its path since (`Commit.discard`).
            self.identity = (st.st_dev, st.st_ino)
            if self._direct:
                self._buf = mmap.mmap(-1, CHUNK)
        except BaseException:
            self._finished = True  # nothing for close() (or the collector) to flush
            self._release()
            raise

    def _open(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        if self._direct:
            try:
                return os.open(self._path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno not in _REFUSALS:
                    raise
                self._direct = False
        return os.open(self._path, flags, 0o644)

    @property
    def crc32(self) -> int:
        """The CRC32 of every byte checksummed so far (all of them once the stream is closed)."""
        return self._checksum_state.crc32

    def checksum(self) -> FileChecksum:
        """Size, CRC32 and block CRC32s of the file; complete once the stream is closed."""
        return self._checksum_state.result()

    @property
    def uses_direct_io(self) -> bool:
        return self._direct

    @property
    def error(self) -> OSError | None:
        """The first I/O error this stream met (with errno and path), or None."""
        return self._error

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        if self._finished:
            raise ValueError(f"write to closed checkpoint file {self._path}")
        if self._error is not None:
            raise self._error
        try:
            return self._write(memoryview(b).cast("B"))  # type: ignore[arg-type]
        except OSError as exc:
            raise self._record(exc)  # noqa: B904 - the recorded error names the path and chains `exc`

    def _write(self, view: memoryview) -> int:
        n = len(view)
        self.size += n
        if self._buf is None:
            self._checksum_state.update(view)
            _write_all(self._fd, view)
            self._offset += n
            return n
        while view:
            take = min(CHUNK - self._fill, len(view))
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == CHUNK:
                self._submit_full_buffer()
        return n

    def _record(self, exc: OSError) -> OSError:
        """Keep the first I/O error, with this file's path in it, and return it."""
        if self._error is None:
            self._error = exc if exc.filename else OSError(exc.errno, exc.strerror, self._path)
            if self._error is not exc:
                self._error.__cause__ = exc
        return self._error

    def _submit_full_buffer(self) -> None:
        assert self._buf is not None
        self._wait_pending()
        full = self._buf
        self._buf = self._spare if self._spare is not None else mmap.mmap(-1, CHUNK)
        self._spare = full
        self._fill = 0
        # The checksum pool has one thread, so blocks are checksummed in file order.
        self._pending = [
            _io_pool().submit(self._write_block, full, CHUNK),
            _crc_pool().submit(self._checksum, full, CHUNK),
        ]

    def _wait_pending(self) -> None:
        """Wait for every submitted block, even after one failed: none may outlive the descriptor."""
        pending, self._pending = self._pending, []
        first: BaseException | None = None
        for future in pending:
            exc = future.exception()
            first = first or exc
        if first is not None:
            raise first

    def _checksum(self, buf: mmap.mmap, nbytes: int) -> None:
        with memoryview(buf) as whole, whole[:nbytes] as data:
            self._checksum_state.update(data)

    def _write_block(self, buf: mmap.mmap, nbytes: int) -> None:
        """Write the first `nbytes` of an aligned buffer, falling back to buffered I/O if refused."""
        with memoryview(buf) as whole, whole[:nbytes] as data:
            try:
                _write_all(self._fd, data)
            except OSError as exc:
                if not self._direct or exc.errno not in _REFUSALS:
                    raise
                self._fall_back()  # rewinds to the last confirmed offset: partial direct writes are redone
                _write_all(self._fd, data)
        self._offset += nbytes

    def _fall_back(self) -> None:
        """Continue with buffered I/O at the last confirmed offset."""
        if not self._direct:
            return
        self._direct = False
        try:
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        except OSError:
            fd, self._fd = self._fd, -1
            os.close(fd)
            self._fd = os.open(self._path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        os.lseek(self._fd, self._offset, os.SEEK_SET)

    def flush(self) -> None:
        """Data stays in the aligned buffer until close; a mid-stream flush would break alignment."""

    def close(self) -> None:
        """Write what is buffered, fsync, close the descriptor once; raise the first I/O error, if any."""
        if self._finished:
            return
        self._finished = True
        try:
            self._wait_pending()
            if self._error is None:
                self._write_tail()
                self._fsync()
        except OSError as exc:
            self._record(exc)
        finally:
            self._release()
        if self._error is not None:
            raise self._error

    def _write_tail(self) -> None:
        buf = self._buf
        if buf is None or not self._fill:
            return
        self._checksum(buf, self._fill)
        aligned = self._fill - self._fill % ALIGN if self._direct else 0
        if aligned:
            self._write_block(buf, aligned)
            buf.move(0, aligned, self._fill - aligned)
            self._fill -= aligned
        if self._fill:
            self._fall_back()  # the unaligned tail cannot go through O_DIRECT
            self._write_block(buf, self._fill)
            self._fill = 0

    def _fsync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            if exc.errno not in _REFUSALS:
                raise
            self._reopen_and_fsync()

    def _release(self) -> None:
        """Close the descriptor (forgotten before the call: never closed twice) and drop the buffers."""
        fd, self._fd = self._fd, -1
        buffers, self._buf, self._spare = (self._buf, self._spare), None, None
        try:
            if fd >= 0:
                self._close_fd(fd)
        except OSError as exc:
            self._record(exc)
        finally:
            for b in buffers:
                _close_buffer(b)
            super().close()

    def _close_fd(self, fd: int) -> None:
        try:
            os.close(fd)  # never retried: on Linux the descriptor is gone even when close reports an error
        except OSError as exc:
            if exc.errno not in _REFUSALS or self._error is not None:
                raise
            self._reopen_and_fsync()  # a late refusal of O_DIRECT: make sure what was written is durable

    def _reopen_and_fsync(self) -> None:
        fd = os.open(self._path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _close_buffer(buf: mmap.mmap | None) -> None:
    """Unmap now if nothing views the buffer; else (a view held by a traceback) when the last view goes."""
    if buf is None:
        return
    with contextlib.suppress(BufferError):
        buf.close()


_POOLS: dict[str, WorkerPool] = {}
_POOL_LOCK = threading.Lock()


def _pool(name: str, workers: int) -> WorkerPool:
    with _POOL_LOCK:
        if name not in _POOLS:
            _POOLS[name] = WorkerPool(workers, name)
        return _POOLS[name]


def _io_pool() -> WorkerPool:
    """Shared by all writers of the process; each writer has at most one block in flight."""
    return _pool("ckpt-io", 2)


def _crc_pool() -> WorkerPool:
    """One thread: a file's blocks must be checksummed in order."""
    return _pool("ckpt-crc", 1)
