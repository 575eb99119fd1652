"""`madvise(2)` through ctypes, for the staging slab and memory-mapped checkpoint reads.

Advice only (`madvise`): without libc, or when the kernel refuses, nothing changes but speed. `populate_write`
is not advice: it allocates and maps the pages of a range, and says so when it cannot.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
from typing import Any

from torch_checkpointing.signals import start_thread

__all__ = ["MADV_DONTNEED", "MADV_RANDOM", "MADV_WILLNEED", "madvise", "populate_write"]

MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED = 1, 3, 4
MADV_POPULATE_WRITE = 23  # Linux 5.14
_POPULATE_PIECE_BYTES = 64 * 1024 * 1024  # smaller ranges are populated by the calling thread alone
_libc: Any = None


def _get_libc() -> Any:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name, use_errno=True) if name else False
        if _libc:
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc


def madvise(start: int, end: int, advice: int) -> None:
    """Advise the kernel on the pages of [start, end), widened down to a page boundary."""
    libc = _get_libc()
    if not libc or end <= start:
        return
    aligned = start - start % mmap.PAGESIZE
    libc.madvise(aligned, end - aligned, advice)


def populate_write(start: int, end: int, workers: int) -> bool:
    """Allocate and map every page of the shared mapping [start, end) (`MADV_POPULATE_WRITE`), split across up
    to `workers` threads: first touch of fresh memory is the kernel's page allocation and zeroing, which runs on
    as many cores as call it, where a copy that faults the pages in pays it on one.

    False where the kernel or libc cannot (nothing was done: the caller reserves the memory its own way);
    OSError (ENOMEM, or EFAULT where a fault would have raised SIGBUS) when the memory is not there.
    """
    libc = _get_libc()
    if not libc or end <= start:
        return bool(libc)
    aligned = start - start % mmap.PAGESIZE
    total = end - aligned
    parts = max(1, min(workers, total // _POPULATE_PIECE_BYTES))
    step = -(-(total // parts) // mmap.PAGESIZE) * mmap.PAGESIZE
    bounds = [(s, min(end, s + step)) for s in range(aligned, end, step)]
    errors: list[int] = [0] * len(bounds)

    def one(i: int) -> None:
        lo, hi = bounds[i]
        if libc.madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
            errors[i] = ctypes.get_errno() or 1

    threads = [threading.Thread(target=one, args=(i,), name="ckpt-populate") for i in range(1, len(bounds))]
    for thread in threads:
        start_thread(thread)
    try:
        one(0)
    finally:
        for thread in threads:
            thread.join()
    failed = [e for e in errors if e]
    if not failed:
        return True
    if all(e == errno.EINVAL for e in failed) and len(failed) == len(bounds):
        return False  # a kernel older than 5.14: the advice is unknown, nothing was populated
    code = next((e for e in failed if e != errno.EINVAL), failed[0])
    raise OSError(code, os.strerror(code))
