"""The floors: a plain memory copy (the staging floor), a raw sequential
write + fsync (the disk floor) and a raw read of the same byte count. Every
engine figure is divided by one of these; benchmarks/engine.py takes the
samples interleaved with its own runs."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .common import as_bytes, now, timed
from .sysinfo import fsync_dir

_CHUNK = 64 << 20


class CopyFloor:
    """Copy every tensor into preallocated (reused) host buffers, as warm staging must.

    The destination is allocated and touched once up front, so each ``once()``
    is a pure copy; the engine section calls it right before each save so the
    floor and our figure share the same moment of a noisy machine.
    """

    def __init__(self, tensors: list[torch.Tensor], device: str) -> None:
        self.pin = device.startswith("cuda")
        self.device = device
        self.src = tensors
        self.dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin) for t in tensors]
        self._copy()

    def _copy(self) -> None:
        for d, s in zip(self.dst, self.src, strict=False):
            d.copy_(s, non_blocking=self.pin)

    def once(self) -> float:
        return timed(self._copy, self.device)


def memcpy_floor(tensors: list[torch.Tensor], runs: int, device: str) -> list[float]:
    floor = CopyFloor(tensors, device)
    return [floor.once() for _ in range(runs)]


def raw_write(host: list[torch.Tensor], path: Path) -> float:
    """One sequential file of the same bytes, fsynced, directory entry fsynced."""
    t0 = now()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in host:
            view = as_bytes(t)
            off = 0
            while off < len(view):
                off += os.write(fd, view[off : off + _CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return now() - t0


def raw_read(path: Path, buf: memoryview) -> float:
    t0 = now()
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < len(buf):
            n = f.readinto(buf[off : off + _CHUNK])
            if not n:
                break
            off += n
    return now() - t0
