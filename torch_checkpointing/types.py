"""Type aliases and small value types shared by every module."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

NestedPath = tuple[str | int, ...]
ItemKey: TypeAlias = str
STATE_DICT: TypeAlias = Mapping[str, Any]


@dataclass
class RankInfo:
    """Who this process is in the job; `role_*` equals `global_*` for plain jobs."""

    global_rank: int
    global_world_size: int
    role_rank: int
    role_world_size: int

    @classmethod
    def single(cls) -> RankInfo:
        """Rank 0 of a one-process job."""
        return cls(0, 1, 0, 1)


@dataclass(frozen=True, slots=True)
class CheckpointPath:
    """One location inside a checkpoint: an item key plus a path inside its value."""

    item_key: str
    nested_path: NestedPath = ()

    def __str__(self) -> str:
        if not self.nested_path:
            return self.item_key
        return f"{self.item_key}::" + ".".join(str(c) for c in self.nested_path)

    def serialize(self) -> str:
        """Compact JSON `["item", "a", 0]`: unambiguous where `str()` is not (keys may contain dots)."""
        return json.dumps([self.item_key, *self.nested_path], separators=(",", ":"))

    @classmethod
    def deserialize(cls, s: str) -> CheckpointPath:
        """The inverse of `serialize()`; an empty list is a `ValueError`."""
        parts = json.loads(s)
        if not parts:
            raise ValueError(f"Cannot deserialize CheckpointPath from empty list: {s!r}")
        return cls(parts[0], tuple(parts[1:]))
