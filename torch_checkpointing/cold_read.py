"""Checking a whole local file whose bytes are not in memory: reads, not faults through a mapping.

A verified load checksums every byte before its first copy. For a file in the page cache a mapping is the fast
way (the CRC reads the cached pages where they lie). For a file that is not, faults through a mapping fetch it a
readahead window at a time, while `pread` of a few MiB per call asks the disk for large reads: on the benchmark
machine 2 streams of 8 MiB reads checked an 862 MB cold file in 0.57-0.66 s against 0.75-0.79 s mapped, and
the same reads of a cached file took twice as long as the mapping. So a load asks first whether the file is
cached (`is_cached`), without reading it.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from concurrent.futures import Executor

from torch_checkpointing.checksum import crc32, crc32_combine
from torch_checkpointing.futures import settle_all

__all__ = [
    "READ_BYTES",
    "crc32_by_reads",
    "is_cached",
    "memory_file",
    "memory_to_spare",
    "private_copy",
    "refuse_beyond_memory",
    "seal",
]

READ_BYTES = 8 * 1024 * 1024  # one pread: large enough for the disk, small enough to stay in the CPU's cache
_PROBES = 8  # pages sampled across the file


def is_cached(fd: int, size: int) -> bool:
    """Whether the file's bytes look resident in the page cache: `_PROBES` pages spread over it, each read with
    RWF_NOWAIT (refused, without waiting for the disk, for a page that is not cached). A system or file system
    without RWF_NOWAIT answers True: the mapping, the path every file took before this module."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or size == 0:
        return True
    page = bytearray(4096)
    for i in range(_PROBES):
        offset = (size * i // _PROBES) & ~4095
        try:
            os.preadv(fd, [page], offset, flag)
        except BlockingIOError:
            return False
        except OSError:
            return True
    return True


def crc32_by_reads(
    fd: int,
    size: int,
    executor: Executor,
    streams: int,
    on_short: Callable[[int], Exception],
    into: int | None = None,
) -> int:
    """CRC32 of bytes [0, size) of `fd`, read in `streams` contiguous parts at once (`pread`, READ_BYTES at a
    time) and combined. A part that ends early (the file shrank under the load) raises `on_short(offset)`.
    `into`: a file (a `memory_file` of `size` bytes) each read is also written to, so the bytes checked are
    the bytes kept, in one pass over the disk."""
    parts = max(1, min(streams, size // READ_BYTES))
    step = -(-size // parts)
    bounds = [(s, min(size, s + step)) for s in range(0, size, step)]
    futures = [executor.submit(_crc32_range, fd, s, e, on_short, into) for s, e in bounds]
    try:
        crcs = [f.result() for f in futures]
    finally:
        settle_all(futures)
    value = 0
    for part_crc, (s, e) in zip(crcs, bounds, strict=True):
        value = crc32_combine(value, part_crc, e - s)
    return value


def _crc32_range(fd: int, start: int, end: int, on_short: Callable[[int], Exception], into: int | None) -> int:
    buffer = memoryview(bytearray(min(READ_BYTES, end - start)))
    value = 0
    offset = start
    while offset < end:
        n = os.preadv(fd, [buffer[: min(READ_BYTES, end - offset)]], offset)
        if n == 0:
            raise on_short(offset)
        value = crc32(buffer[:n], value)
        if into is not None:
            _write_all(into, buffer[:n], offset)
        offset += n
    return value


def private_copy(fd: int, size: int, on_short: Callable[[int], Exception]) -> int | None:
    """A descriptor of an anonymous in-memory copy (memfd) of bytes [0, size) of `fd`, or None where the system
    has no memfd (there the caller reads the file itself, as before).

    A load decodes what it verified from this copy, never from a mapping of the checkpoint's file: through a
    mapping, a file written into in place after its check changed the tensors a load had returned (they were
    views of the file), or handed out bytes nobody checked; one truncated meanwhile killed the process with
    SIGBUS at the first touch of a page past its new end. A file ending early raises `on_short(offset)`."""
    copy = memory_file(0)
    if copy is None:
        return None
    try:
        done = 0
        while done < size:
            n = _copy_some(copy, fd, done, min(size - done, 1 << 30))
            if n == 0:
                raise on_short(done)
            done += n
        seal(copy)
        os.lseek(copy, 0, os.SEEK_SET)  # read from the start, as a file just opened (the copy wrote to its end)
    except BaseException:
        os.close(copy)
        raise
    return copy


def refuse_beyond_memory(size: int, where: str, reader: str) -> None:
    """Raise a `MemoryError` naming `where` when an in-memory copy of `size` bytes (`private_copy`, which `reader`
    makes before reading the file) cannot fit in the memory there is (`memory_to_spare`). That copy is memory
    RLIMIT_AS does not count: a sparse 1 TiB file (no disk used) was copied until the machine ran out, where the
    reader can say at once that it does not fit, and never that the file is damaged."""
    spare = memory_to_spare()
    if spare is not None and size > spare:
        raise MemoryError(
            f"Out of memory reading {where}: {reader} copies it into memory before reading it, and its {size} bytes "
            f"are more than the {spare} this machine has available (memory and swap); the checkpoint was not found "
            f"damaged (do not delete it). Read it on a machine with more memory, or free some and try again."
        )


def memory_to_spare() -> int | None:
    """Bytes an in-memory file can still take: the memory the kernel says is available without swapping
    (MemAvailable) plus free swap, or None where /proc/meminfo does not say. A memory cgroup's own limit is not
    looked at: a load in a container is bounded by the machine's memory here, and its cgroup's OOM killer past
    that."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "SwapFree"):
                    fields[name] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


def memory_file(size: int) -> int | None:
    """A new anonymous file in memory of `size` bytes (zeros), or None where the system has no memfd."""
    make = getattr(os, "memfd_create", None)
    if make is None:
        return None
    fd: int = make("checkpoint-file", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    if size:
        os.ftruncate(fd, size)
    return fd


def seal(fd: int) -> None:
    """Seal a finished `memory_file` against shrinking and growing: no mapping of it can fault past its end."""
    seals = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
    if seals and hasattr(fcntl, "F_ADD_SEALS"):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)


def _copy_some(out: int, fd: int, offset: int, count: int) -> int:
    """Copy up to `count` bytes at `offset` of `fd` to the end of `out` in the kernel; by reads where it refuses."""
    try:
        return os.sendfile(out, fd, offset, count)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    data = os.pread(fd, min(count, READ_BYTES), offset)
    view = memoryview(data)
    while view:
        view = view[os.write(out, view) :]
    return len(data)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
