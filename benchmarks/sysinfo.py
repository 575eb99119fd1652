"""Operating-system measurements: page cache, /proc counters, RSS, fsync."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Iterable
from pathlib import Path

import torch


def median(xs: Iterable[float]) -> float:
    vals = list(xs)
    if not vals:
        raise ValueError("median of no samples: the measurement produced no runs")
    return float(statistics.median(vals))


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [Path(root) / f for root, _, names in os.walk(path) for f in names]


def drop_page_cache(path: Path) -> None:
    """Evict a checkpoint's files from the page cache (POSIX_FADV_DONTNEED).

    fdatasync first: DONTNEED only drops clean pages. Needs no privileges, unlike
    /proc/sys/vm/drop_caches; whether it took effect is checked by the floors
    section (cold vs warm raw-read throughput) and reported.
    """
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def proc_io(pid: str = "self") -> dict[str, int]:
    """rchar (bytes passed to read-family syscalls, cache hits included) and
    read_bytes (bytes the block layer fetched for this process)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k.strip()] = int(v)
    return out


def proc_mem(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) in bytes; empty if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssShmem", "RssAnon"):
            out[k] = int(v.split()[0]) * 1024
    return out


def descendants(pid: int | None = None) -> list[int]:
    """Child processes (recursively), read from /proc without psutil."""
    root = os.getpid() if pid is None else pid
    found: list[int] = []
    stack = [root]
    while stack:
        p = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except FileNotFoundError:
                continue
            for k in kids:
                found.append(int(k))
                stack.append(int(k))
    return found


def machine() -> dict[str, object]:
    """What the numbers were measured on."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / (1 << 30), 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }
