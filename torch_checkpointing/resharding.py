"""The resharder contract: record how an item is sharded on save, redistribute it on load."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_checkpointing.distributed_metadata import (
    DistributedItemMetadata,
    ShardingMetadata,
    field_int,
    field_ints,
)
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.types import NestedPath, check_path_map, checked_nested_path

__all__ = ["LoadPlan", "Resharder", "ReshardingInfo"]


@dataclass
class LoadPlan:
    """Copy one rectangular block from a source rank's local tensor into this rank's local tensor.

    `offsets` index the target's local tensor, `src_offsets` the source rank's local tensor; the block
    has `sizes` (== `src_sizes`) elements per dimension. A strided (non-contiguous) local layout is
    expressed as several plans, one per contiguous run.

    `transpose_dims` is accepted for code written against the published release and ignored: no resharder
    of this package reads it, so a non-empty value warns (FutureWarning) and the block is copied untransposed.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src_rank: int
    src_fqn: str
    src_offsets: tuple[int, ...]
    src_sizes: tuple[int, ...]
    transpose_dims: tuple[int, ...] = ()
    src_elem_size: int = 0
    src_dtype: str = ""

    def __post_init__(self) -> None:
        """Refuse a field of the wrong type naming it: a plan took anything, and a resharder's copy failed later, far
        from the plan that was wrong, in words about slices (a str `src_rank` found no file; `sizes="22"`, a
        `TypeError` deep in the copy)."""
        record = "LoadPlan"
        self.offsets = field_ints(self.offsets, "offsets", record)
        self.sizes = field_ints(self.sizes, "sizes", record)
        self.src_offsets = field_ints(self.src_offsets, "src_offsets", record)
        self.src_sizes = field_ints(self.src_sizes, "src_sizes", record)
        dims = {len(self.offsets), len(self.sizes), len(self.src_offsets), len(self.src_sizes)}
        if len(dims) > 1:
            raise ConfigError(
                f"{record} for {self.src_fqn!r}: offsets, sizes, src_offsets and src_sizes must have one length each "
                f"(one entry per dimension), got {self.offsets}, {self.sizes}, {self.src_offsets}, {self.src_sizes}"
            )
        self.src_rank = field_int(self.src_rank, "src_rank", record)
        self.src_elem_size = field_int(self.src_elem_size, "src_elem_size", record)
        for name in ("src_fqn", "src_dtype"):
            if not isinstance(getattr(self, name), str):
                value = getattr(self, name)
                raise ConfigTypeError(f"{record}.{name} must be a str, got {type(value).__name__} {value!r:.80}")
        self.transpose_dims = field_ints(self.transpose_dims, "transpose_dims", record)
        if self.transpose_dims:
            warnings.warn(
                f"LoadPlan.transpose_dims={self.transpose_dims!r} (for {self.src_fqn!r}) is ignored: no resharder "
                f"transposes blocks, and the field will be removed. Plan untransposed blocks instead.",
                FutureWarning,
                stacklevel=3,
            )

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


@dataclass
class ReshardingInfo:
    """The plans for every target path of one item, and the paths that cannot be resharded."""

    nested_path_to_load_plans: dict[NestedPath, list[LoadPlan]] = field(default_factory=dict)
    non_reshardable_paths: list[NestedPath] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Refuse a field of the wrong type naming it (it took anything, and failed later in the copy)."""
        record = "ReshardingInfo"
        check_path_map(self.nested_path_to_load_plans, f"{record}.nested_path_to_load_plans", LoadPlan)
        if not isinstance(self.non_reshardable_paths, list):
            raise ConfigTypeError(
                f"{record}.non_reshardable_paths must be a list of nested paths, got "
                f"{type(self.non_reshardable_paths).__name__} {self.non_reshardable_paths!r:.80}"
            )
        what = f"{record}.non_reshardable_paths entry"
        self.non_reshardable_paths = [checked_nested_path(path, what) for path in self.non_reshardable_paths]


class Resharder(ABC):
    """Maps an item saved under one distributed layout onto this rank's layout at load time.

    What the engine calls, and when (an item uses a resharder when its `ItemSpec.resharder` is set):

    * save, on every rank, while the ranks agree on the plan: `extract_sharding_metadata(key, value)` for the
      value being saved. Rank 0 gathers every rank's result into the checkpoint's sharding metadata file.
    * load, per item, in this order: `skip_resharding` (True: the item is read directly, and the metadata
      file is not read for it); then, if the checkpoint has sharding metadata for the item,
      `extract_sharding_metadata(key, target)` on the template being loaded into; then
      `should_reshard(source, target)` with the two; and only when that returns True, `load(...)`, in the
      copy phase (which starts once every item's files were checked, so nothing is copied into a template
      before that). An item not resharded is read directly from this rank's file. For a `DTensorResharder`
      the plan is made once, in the check phase (it names the files to verify and every block is checked
      there); unless a subclass overrides `load` (or `load_as_rank`), that planned job runs in place of the call.

    Each call runs on the caller's thread, never in the writer process. `load` fills `target` in place and
    returns the paths it could not fill; they are reported as missing (`strict=True` refuses them). A `load`
    that replaces or resizes a template tensor instead (`target[name] = saved`) is named in a WARNING once it
    returns (the returned mapping holds the new object; the caller's own tensor there was not restored), and a
    template tensor it removes counts as not filled. Before a
    `load` of your own is called, every file of the item (each rank's, as `source_metadata` lists them) has been
    checked whole (for a `DTensorResharder` subclass: every block its planned job reads), so what it reads of
    them through `storage` is what was committed; a file outside the item (or a block beyond that plan) is
    checked as it is read, and a failure there (or an exception of the `load` itself) leaves what it had
    written in `target`: the error says so.

    What the engine cannot check for an overriding `load`: its copies. The direct and `DTensorResharder`
    paths refuse, before any copy, template entries that share memory (tied weights, overlapping views) but
    would be filled with different saved values; an overriding `load` writes into `target` itself, so the
    engine sees neither the values nor their order. It logs a WARNING naming each such pair before the call,
    and the `load` must check them (or the caller untie them and tie them again after the load): otherwise
    the last write wins. Handing the `load` an untied scratch copy instead would double the item's memory and
    change the object this extension point has always filled in place.
    """

    @property
    def skip_resharding(self) -> bool:
        """True lets the loader skip metadata entirely (direct reads) for items using this resharder."""
        return False

    @abstractmethod
    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[NestedPath, ShardingMetadata]:
        """This rank's metadata for each shardable object inside `item_value`; it must pickle."""

    def should_reshard(
        self,
        source_metadata: DistributedItemMetadata | None,
        target_metadata: dict[NestedPath, ShardingMetadata] | None,
    ) -> bool:
        """Reshard iff some target path that the source also has was saved with a different layout."""
        if source_metadata is not None and not isinstance(source_metadata, DistributedItemMetadata):
            raise ConfigTypeError(
                f"Resharder.should_reshard: source_metadata must be a DistributedItemMetadata or None, got "
                f"{type(source_metadata).__name__} {source_metadata!r:.80}"
            )
        if target_metadata is not None and not isinstance(target_metadata, dict):
            raise ConfigTypeError(
                f"Resharder.should_reshard: target_metadata must be a dict of nested path -> ShardingMetadata (what "
                f"extract_sharding_metadata returns) or None, got {type(target_metadata).__name__} "
                f"{target_metadata!r:.80}"
            )
        if source_metadata is None or target_metadata is None:
            return False
        for path, target in target_metadata.items():
            groups = source_metadata.nested_path_to_metadata.get(tuple(path))
            if groups is None:
                continue
            if not any(group.sharding_metadata == target for group in groups):
                return True
        return False

    @abstractmethod
    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: dict[NestedPath, ShardingMetadata],
        source_metadata: DistributedItemMetadata,
        target: Any,
        storage: Storage,
    ) -> list[NestedPath]:
        """Fill `target` in place from the source checkpoint; return the paths it could not fill."""
