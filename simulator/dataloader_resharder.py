"""A custom resharder for dataloader progress, written only against the public Resharder API.

Sampling is strided: with W ranks, rank r reads samples r, r+W, r+2W, ... . After
the job as a whole has consumed the first T samples, rank r has consumed
ceil((T - r) / W) of them and reads sample T + ((r - T) mod W) next. Moving from
N to M ranks means recovering T from every source rank's file and recomputing
each target rank's share: exactly the "non-DTensor sharded state" case the
design document leaves to a user Resharder.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from simulator.backend import backend_module

_dm = backend_module("distributed_metadata")
_rs = backend_module("resharding")


def dataloader_state(rank: int, world: int, total: int) -> dict[str, int]:
    """The per-rank state of a strided sampler after the job consumed samples [0, total)."""
    consumed = max(0, (total - rank + world - 1) // world)
    return {"rank": rank, "world": world, "samples_consumed": consumed, "next_sample": total + (rank - total) % world}


@dataclass(frozen=True)
class DataloaderSharding(_dm.ShardingMetadata, type_name="SimulatorDataloaderSharding"):  # type: ignore[misc, name-defined, call-arg]
    """Which rank of how many held a dataloader state; equal only for the same position in the same world."""

    rank: int
    world: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.world}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataloaderSharding:
        return cls(rank=int(d["rank"]), world=int(d["world"]))

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DataloaderResharder(_rs.Resharder):  # type: ignore[misc, name-defined]
    """Redistributes strided-sampler progress from the source world onto this rank of the target world."""

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[Any, Any]:
        rank, world = _world()
        return {(): DataloaderSharding(rank, world)}

    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: dict[Any, Any],
        source_metadata: Any,
        target: Any,
        storage: Any,
    ) -> list[Any]:
        meta = target_metadata.get(())
        if not isinstance(meta, DataloaderSharding):
            return [()]
        total = 0
        for rank in sorted(source_metadata.rank_to_layout_info):
            raw = storage.read(source_metadata.get_file_path(rank, Path(source_path), item_key))
            saved = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            total += int(saved["samples_consumed"])
        target.update(dataloader_state(meta.rank, meta.world, total))
        return []
