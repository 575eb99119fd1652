"""Probes the tests share to look at the process from outside the engine's API.

* `memory_maps()`: this process's memory mappings, read from /proc/self/maps, to see which files (staging
  slabs, memory-mapped checkpoint files) are mapped right now, without asking the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["MappedRegion", "memory_maps"]


@dataclass(frozen=True)
class MappedRegion:
    """One line of /proc/self/maps: an address range and what backs it (`path` is "" for anonymous memory)."""

    start: int
    end: int
    perms: str
    inode: str
    path: str


def _region(line: str) -> MappedRegion:
    # address perms offset dev inode [path]; the path may hold spaces (and ends " (deleted)" once unlinked)
    fields = line.split(maxsplit=5)
    start, end = (int(x, 16) for x in fields[0].split("-"))
    path = fields[5].strip() if len(fields) > 5 else ""
    return MappedRegion(start, end, fields[1], fields[4], path)


def memory_maps() -> list[MappedRegion]:
    """Every mapping of this process, in address order, read now."""
    return [_region(line) for line in Path("/proc/self/maps").read_text().splitlines() if line]
