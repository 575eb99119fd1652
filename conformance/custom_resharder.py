"""A custom Resharder for non-DTensor dataloader progress, written as the document describes.

Module level so that rank processes (and any writer subprocess) can import it. Every
call is recorded in ``CALLS`` so that multi-rank tests can check what the manager
passed in (RESHARD-AUTO-2, RESHARD-CUSTOM-1).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conformance import backend

ShardingMetadata = backend.name("distributed_metadata", "ShardingMetadata")
Resharder = backend.name("resharding", "Resharder")

CALLS: list[dict[str, Any]] = []


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class LoaderShardMeta(ShardingMetadata):  # type: ignore[misc, valid-type]
    """Which rank's dataloader shard this is, out of how many."""

    rank: int
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoaderShardMeta:
        return cls(int(d["rank"]), int(d["world_size"]))

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None


class DataloaderResharder(Resharder):  # type: ignore[misc, valid-type]
    """Merges every source rank's dataloader position into the target on load."""

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[Any, Any]:
        rank, world = _rank_and_world()
        CALLS.append(
            {
                "call": "extract",
                "item_key": item_key,
                "value_id": id(item_value),
                "position": item_value.get("position") if isinstance(item_value, dict) else None,
            }
        )
        return {(): LoaderShardMeta(rank, world)}

    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: dict[Any, Any],
        source_metadata: Any,
        target: Any,
        storage: Any,
    ) -> list[Any]:
        ranks = sorted(source_metadata.get_all_ranks())
        positions = []
        for r in ranks:
            path = source_metadata.get_file_path(r, Path(source_path), item_key)
            positions.append(torch.load(io.BytesIO(storage.read(path)), weights_only=False)["position"])
        CALLS.append(
            {
                "call": "load",
                "source_path": str(source_path),
                "item_key": item_key,
                "target_id": id(target),
                "target_metadata": dict(target_metadata),
                "source_is_item_metadata": isinstance(
                    source_metadata, backend.name("distributed_metadata", "DistributedItemMetadata")
                ),
                "source_per_rank": {r: source_metadata.get_metadata_for_path_and_rank((), r) for r in ranks},
                "storage_is_storage": isinstance(storage, backend.name("storage.base_storage", "Storage")),
            }
        )
        target["positions"] = positions
        return []


@dataclass(frozen=True)
class ChunkMeta(ShardingMetadata):  # type: ignore[misc, valid-type]
    """How many chunks this rank's value is cut into: a different count is a different layout."""

    chunks: int

    def to_dict(self) -> dict[str, Any]:
        return {"chunks": self.chunks}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChunkMeta:
        return cls(int(d["chunks"]))

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None


class ChunkResharder(Resharder):  # type: ignore[misc, valid-type]
    """Re-cuts ``{"chunks": [tensor, ...]}`` saved as one number of chunks into the target's number.

    The layout is the chunk count, so a single process can save under one layout and load under
    another (RESHARD-AUTO-3). Every ``load`` call is recorded in ``CALLS``.
    """

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[Any, Any]:
        return {(): ChunkMeta(len(item_value["chunks"]))}

    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: dict[Any, Any],
        source_metadata: Any,
        target: Any,
        storage: Any,
    ) -> list[Any]:
        saved = []
        for r in sorted(source_metadata.get_all_ranks()):
            path = source_metadata.get_file_path(r, Path(source_path), item_key)
            saved.extend(torch.load(io.BytesIO(storage.read(path)), weights_only=True)["chunks"])
        whole = torch.cat(saved)
        for dst, src in zip(target["chunks"], whole.chunk(len(target["chunks"])), strict=True):
            dst.copy_(src)
        CALLS.append({"call": "chunk-load", "source_path": str(source_path), "item_key": item_key})
        return []
