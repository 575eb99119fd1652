"""The floors: a plain memory copy (the staging floor), a raw sequential
write + fsync (the disk floor) and a raw read of the same byte count, cold and
warm. Every engine figure is divided by one of these."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .common import as_bytes, build_state, fresh_dir, now, remove, sync, timed
from .config import BenchConfig
from .state import nbytes, tensors_of
from .sysinfo import drop_page_cache, fsync_dir

_CHUNK = 64 << 20


def memcpy_floor(tensors: list[torch.Tensor], runs: int, device: str) -> list[float]:
    """Copy every tensor into preallocated (reused) host buffers, as warm staging must."""
    pin = device.startswith("cuda")
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]

    def copy() -> None:
        for d, s in zip(dst, tensors):
            d.copy_(s, non_blocking=pin)

    copy()  # first touch of the destination pages is not part of the floor
    return [timed(copy, device) for _ in range(runs)]


def raw_write(host: list[torch.Tensor], path: Path) -> float:
    """One sequential file of the same bytes, fsynced, directory entry fsynced."""
    t0 = now()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in host:
            view = as_bytes(t)
            off = 0
            while off < len(view):
                off += os.write(fd, view[off:off + _CHUNK])
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
            n = f.readinto(buf[off:off + _CHUNK])
            if not n:
                break
            off += n
    return now() - t0


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    state = build_state(cfg)
    tensors = tensors_of(state)
    total = nbytes(state)
    out: dict[str, Any] = {"bytes": total, "memcpy_s": memcpy_floor(tensors, cfg.runs, cfg.device)}
    host = [t.cpu() for t in tensors]
    sync(cfg.device)
    d = fresh_dir(workdir / "raw")
    d.mkdir()
    writes = []
    for i in range(cfg.runs):
        path = d / f"raw_{i}.bin"
        writes.append(raw_write(host, path))
        if i + 1 < cfg.runs:
            remove(path)
    out["raw_write_s"] = writes
    if not cfg.saves_only:
        path = d / f"raw_{cfg.runs - 1}.bin"
        buf = memoryview(bytearray(total))
        raw_read(path, buf)  # touch the destination once
        cold, warm = [], []
        for _ in range(cfg.runs):
            drop_page_cache(path)
            cold.append(raw_read(path, buf))
            warm.append(raw_read(path, buf))
        out["raw_read_cold_s"] = cold
        out["raw_read_warm_s"] = warm
    remove(d)
    return out
