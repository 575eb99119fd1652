"""The sharding-metadata pipeline, wired automatically when any ItemSpec declares a resharder.

On save each rank extracts metadata for its resharder items; the manager gathers every rank's extraction
over its own gloo group and rank 0 stores the result as JSON beside the shards. On load the target metadata
is extracted afresh from the `into=` templates every time (never cached), so each load reshards correctly.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

from torch_checkpointing.distributed_metadata import (
    STORED_DATA_DEPTH,
    DistributedMetadata,
    ItemMetadata,
    ShardingMetadata,
    build_distributed_metadata,
    recordable_path,
)
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.read_context import MAX_METADATA_BYTES
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
            check_extracted(type(resharder).__name__, item.key, extracted)
            check_storable(type(resharder).__name__, item.key, extracted)
            if extracted:
                out[item.key] = extracted
        return out

    def compute_metadata(
        self, per_rank: list[dict[str, ItemMetadata]], per_rank_layouts: list[dict[str, Any]]
    ) -> DistributedMetadata:
        return build_distributed_metadata(per_rank, per_rank_layouts, len(per_rank))

    def serialize(self, per_rank: list[dict[str, ItemMetadata]], per_rank_layouts: list[dict[str, Any]]) -> str:
        """metadata.json's text; one larger than a load reads back is refused before it is written."""
        text = self.compute_metadata(per_rank, per_rank_layouts).to_json()
        if len(text) > MAX_METADATA_BYTES:  # json.dumps writes ASCII: one byte per character
            raise ConfigError(
                f"The sharding metadata of this save is {len(text)} bytes, larger than a load reads back "
                f"({MAX_METADATA_BYTES}): a resharder's ShardingMetadata.to_dict() returns too much. Store the data "
                f"itself in the item, and only what resharding needs in its metadata."
            )
        return text


def check_extracted(resharder: str, key: str, extracted: object) -> None:
    """A resharder's result, checked where it is returned: a wrong one failed later with an AttributeError
    (`'list' object has no attribute 'items'`, `'str' object has no attribute '_pack'`) that named nothing."""
    where = f"{resharder}.extract_sharding_metadata for item '{key}'"
    if not isinstance(extracted, dict):
        raise ConfigTypeError(
            f"{where} returned {type(extracted).__name__}; it must return a dict of nested path (a tuple such as "
            f"('layers', 0, 'w')) -> ShardingMetadata, {{}} when the item has nothing to describe."
        )
    for path, meta in extracted.items():
        if not isinstance(path, tuple) or not isinstance(meta, ShardingMetadata):
            raise ConfigTypeError(
                f"{where} returned the entry {path!r}: {type(meta).__name__}; each key must be a nested path (a "
                f"tuple such as ('w',)) and each value a ShardingMetadata (e.g. DTensorShardingMetadata)."
            )
        recordable_path(path, key)  # here, where the item is known: the records built from it name none


def check_storable(resharder: str, key: str, extracted: dict[Any, ShardingMetadata]) -> None:
    """A save's metadata, checked before anything is written: what a resharder of the user's returns must be
    JSON that metadata.json holds as it was given (the engine's own classes are)."""
    for path, meta in extracted.items():
        if not type(meta).__module__.startswith(_ENGINE):
            where = f"{resharder}.extract_sharding_metadata for item '{key}', entry {path!r}"
            _check_stored_json(f"{where}: {type(meta).__name__}.to_dict()", meta.to_compact_dict())


_ENGINE = "torch_checkpointing."


def _check_stored_json(where: str, value: object, field: str = "", depth: int = 1) -> None:
    """Refuse, before anything is written, what metadata.json cannot hold as it was given.

    A set or a tensor failed rank 0's save with a bare "Object of type set is not JSON serializable"; a NaN was
    written as the non-standard `NaN`, so the save committed a checkpoint that every load then refused as damaged;
    an int key came back as a str.
    """
    at = f" at {field!r}" if field else ""
    if depth > STORED_DATA_DEPTH:
        raise ConfigError(
            f"{where} nests deeper than {STORED_DATA_DEPTH} levels{at}, deeper than a load reads metadata.json "
            f"back. Flatten it (e.g. a list of records instead of nested objects)."
        )
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigTypeError(f"{where} holds the {type(key).__name__} key {key!r}{at}: {_JSON_ONLY}")
            _check_stored_json(where, item, f"{field}.{key}" if field else key, depth + 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_stored_json(where, item, f"{field}[{index}]", depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} holds {value}{at}, which JSON has no number for: {_JSON_ONLY}")
    elif value is not None and not isinstance(value, (str, int, float)):
        raise ConfigTypeError(f"{where} holds a {type(value).__name__}{at}: {_JSON_ONLY}")


_JSON_ONLY = (
    "metadata.json stores only JSON values. Return str, int, finite float, bool, None, and lists and dicts with "
    "str keys of those (e.g. a list for a set, tensor.tolist() for a tensor, None for a missing number)."
)
