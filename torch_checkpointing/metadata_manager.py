"""The sharding-metadata pipeline, wired automatically when any ItemSpec declares a resharder.

On save each rank extracts metadata for its resharder items; the manager gathers every rank's extraction
over its own gloo group and rank 0 stores the result as JSON beside the shards. On load the target metadata
is extracted afresh from the `into=` templates every time (never cached), so each load reshards correctly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch_checkpointing.distributed_metadata import DistributedMetadata, ItemMetadata, build_distributed_metadata
from torch_checkpointing.schema import ResolvedItem

__all__ = ["DefaultMetadataManager", "MetadataManager"]


class MetadataManager(ABC):
    @abstractmethod
    def extract_object_metadata(self, items: list[ResolvedItem]) -> dict[str, ItemMetadata]:
        """This rank's metadata per resharder item (items with nothing to describe are left out)."""

    @abstractmethod
    def compute_metadata(
        self, per_rank: list[dict[str, ItemMetadata]], per_rank_layouts: list[dict[str, Any]]
    ) -> DistributedMetadata: ...

    def close(self) -> None:
        return None


class DefaultMetadataManager(MetadataManager):
    def extract_object_metadata(self, items: list[ResolvedItem]) -> dict[str, ItemMetadata]:
        out: dict[str, ItemMetadata] = {}
        for item in items:
            resharder = item.spec.resharder
            if resharder is None:
                continue
            extracted = resharder.extract_sharding_metadata(item.key, item.value)
            if extracted:
                out[item.key] = extracted
        return out

    def compute_metadata(
        self, per_rank: list[dict[str, ItemMetadata]], per_rank_layouts: list[dict[str, Any]]
    ) -> DistributedMetadata:
        return build_distributed_metadata(per_rank, per_rank_layouts, len(per_rank))

    def serialize(self, per_rank: list[dict[str, ItemMetadata]], per_rank_layouts: list[dict[str, Any]]) -> str:
        return self.compute_metadata(per_rank, per_rank_layouts).to_json()
