"""`madvise(2)` through ctypes, for the staging slab and memory-mapped checkpoint reads.

Advice only: without libc, or when the kernel refuses, nothing changes but speed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from typing import Any

__all__ = ["MADV_DONTNEED", "MADV_RANDOM", "MADV_WILLNEED", "madvise"]

MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED = 1, 3, 4
_libc: Any = None


def madvise(start: int, end: int, advice: int) -> None:
    """Advise the kernel on the pages of [start, end), widened down to a page boundary."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name, use_errno=True) if name else False
        if _libc:
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if not _libc or end <= start:
        return
    aligned = start - start % mmap.PAGESIZE
    _libc.madvise(aligned, end - aligned, advice)
