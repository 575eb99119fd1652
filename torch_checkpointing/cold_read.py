"""Checking a whole local file whose bytes are not in memory: reads, not faults through a mapping.

A verified load checksums every byte before its first copy. For a file in the page cache a mapping is the fast
way (the CRC reads the cached pages where they lie). For a file that is not, faults through a mapping fetch it a
readahead window at a time, while `pread` of a few MiB per call asks the disk for large reads: on the benchmark
machine 2 streams of 8 MiB reads checked an 862 MB cold file in 0.57-0.66 s against 0.75-0.79 s mapped, and
the same reads of a cached file took twice as long as the mapping. So a load asks first whether the file is
cached (`is_cached`), without reading it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Executor

from torch_checkpointing.checksum import crc32, crc32_combine
from torch_checkpointing.futures import settle_all

__all__ = ["READ_BYTES", "crc32_by_reads", "is_cached"]

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


def crc32_by_reads(fd: int, size: int, executor: Executor, streams: int, on_short: Callable[[int], Exception]) -> int:
    """CRC32 of bytes [0, size) of `fd`, read in `streams` contiguous parts at once (`pread`, READ_BYTES at a
    time) and combined. A part that ends early (the file shrank under the load) raises `on_short(offset)`."""
    parts = max(1, min(streams, size // READ_BYTES))
    step = -(-size // parts)
    bounds = [(s, min(size, s + step)) for s in range(0, size, step)]
    futures = [executor.submit(_crc32_range, fd, s, e, on_short) for s, e in bounds]
    try:
        crcs = [f.result() for f in futures]
    finally:
        settle_all(futures)
    value = 0
    for part_crc, (s, e) in zip(crcs, bounds, strict=True):
        value = crc32_combine(value, part_crc, e - s)
    return value


def _crc32_range(fd: int, start: int, end: int, on_short: Callable[[int], Exception]) -> int:
    buffer = memoryview(bytearray(min(READ_BYTES, end - start)))
    value = 0
    offset = start
    while offset < end:
        n = os.preadv(fd, [buffer[: min(READ_BYTES, end - offset)]], offset)
        if n == 0:
            raise on_short(offset)
        value = crc32(buffer[:n], value)
        offset += n
    return value
