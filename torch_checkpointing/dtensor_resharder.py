"""Reshard DTensor (and plain tensor) state between any two meshes and placements.

Every rank's local data is, per tensor dimension, an ordered list of contiguous runs of global
indices: one run for `Shard`, several for `_StridedShard`, the whole dimension for `Replicate`.
Intersecting this rank's runs with each source rank's runs, dimension by dimension, gives the
rectangular blocks (`LoadPlan`s) to copy; only those blocks are read from the source files.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from torch_checkpointing.distributed_metadata import DistributedItemMetadata, ShardingMetadata
from torch_checkpointing.dtensor_metadata import (
    DTensorShardingMetadata,
    ReplicateSpec,
    ShardSpec,
    StridedShardSpec,
)
from torch_checkpointing.errors import CorruptCheckpointError, TemplateMismatchError
from torch_checkpointing.resharding import LoadPlan, Resharder, ReshardingInfo
from torch_checkpointing.source_reader import ReadStats, SourceFile, SourceTensor, dotted_key, open_source_file
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.types import NestedPath

__all__ = [
    "DTensorResharder",
    "check_reshard_targets",
    "compute_load_plans",
    "compute_local_runs",
    "compute_local_shard_info",
    "plan_resharding",
]

logger = logging.getLogger(__name__)


class Run(NamedTuple):
    """`length` consecutive global indices starting at `global_start`, stored from `local_start` on."""

    global_start: int
    local_start: int
    length: int


_Segments = list[tuple[int, int]]  # (global_start, length) in local order


def _take(segments: _Segments, start: int, stop: int) -> _Segments:
    """Local positions [start, stop) of a segment list."""
    out: _Segments = []
    pos = 0
    for g, n in segments:
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((g + lo - pos, hi - lo))
        pos += n
        if pos >= stop:
            break
    return out


def _chunk(segments: _Segments, num_chunks: int, index: int) -> _Segments:
    """torch.chunk semantics: chunks of ceil(L / num_chunks), trailing chunks short or empty."""
    total = sum(n for _, n in segments)
    size = -(-total // num_chunks)
    return _take(segments, min(index * size, total), min((index + 1) * size, total))


def _strided_chunk(segments: _Segments, split_factor: int, num_chunks: int, index: int) -> _Segments:
    """_StridedShard: chunk into split_factor pieces, then take chunk `index` of each piece."""
    out: _Segments = []
    for j in range(split_factor):
        out.extend(_chunk(_chunk(segments, split_factor, j), num_chunks, index))
    return out


def _to_runs(segments: _Segments) -> list[Run]:
    runs: list[Run] = []
    local = 0
    for g, n in segments:
        if n == 0:
            continue
        if runs and runs[-1].global_start + runs[-1].length == g:
            last = runs[-1]
            runs[-1] = Run(last.global_start, last.local_start, last.length + n)
        else:
            runs.append(Run(g, local, n))
        local += n
    return runs


def compute_local_runs(metadata: DTensorShardingMetadata, rank: int) -> tuple[list[Run], ...]:
    """Per tensor dimension, the runs of global indices `rank` holds, in local order."""
    coord = metadata.mesh_spec.get_coordinate(rank)
    if coord is None:
        raise ValueError(f"Rank {rank} is not in the device mesh {metadata.mesh_spec.mesh_data}")
    segments: list[_Segments] = [[(0, n)] for n in metadata.global_shape]
    for mesh_dim, placement in enumerate(metadata.placements):
        k, c = metadata.mesh_spec.mesh_shape[mesh_dim], coord[mesh_dim]
        if isinstance(placement, StridedShardSpec):
            segments[placement.dim] = _strided_chunk(segments[placement.dim], placement.split_factor, k, c)
        elif isinstance(placement, ShardSpec):
            segments[placement.dim] = _chunk(segments[placement.dim], k, c)
        elif not isinstance(placement, ReplicateSpec):
            raise ValueError(f"Unsupported placement {placement!r} in sharding metadata")
    return tuple(_to_runs(s) for s in segments)


def compute_local_shard_info(metadata: DTensorShardingMetadata, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset of the first local element per dim; the dim size when empty).

    For `_StridedShard` the offset is only the first run's start: use `compute_local_runs` for all of them.
    """
    runs = compute_local_runs(metadata, rank)
    shape = tuple(sum(r.length for r in dim_runs) for dim_runs in runs)
    offset = tuple(
        dim_runs[0].global_start if dim_runs else n for dim_runs, n in zip(runs, metadata.global_shape, strict=True)
    )
    return shape, offset


def _overlaps(target: list[Run], source: list[Run]) -> list[tuple[int, int, int]]:
    """(target local offset, source local offset, length) for each overlap of two run lists."""
    out = []
    for t in target:
        for s in source:
            lo = max(t.global_start, s.global_start)
            hi = min(t.global_start + t.length, s.global_start + s.length)
            if lo < hi:
                out.append((t.local_start + lo - t.global_start, s.local_start + lo - s.global_start, hi - lo))
    return out


def _source_ranks(source_groups: list[Any]) -> list[tuple[int, DTensorShardingMetadata]]:
    ranks: dict[int, DTensorShardingMetadata] = {}
    for group in source_groups:
        md = group.sharding_metadata
        for rank in group.ranks:
            if md.mesh_spec.get_coordinate(rank) is not None:
                ranks.setdefault(rank, md)
    return sorted(ranks.items())


def compute_load_plans(
    nested_path: NestedPath,
    target: DTensorShardingMetadata,
    source_groups: list[Any],
    rank: int,
) -> list[LoadPlan] | None:
    """Plans filling `rank`'s local shard of `target` from the source ranks; None if they cannot cover it.

    Source ranks holding identical index sets (replicas) are read once, from the lowest rank.
    """
    target_runs = compute_local_runs(target, rank)
    target_numel = 1
    for dim_runs in target_runs:
        target_numel *= sum(r.length for r in dim_runs)
    fqn = dotted_key(nested_path)
    plans: list[LoadPlan] = []
    seen: set[tuple[tuple[Run, ...], ...]] = set()
    for src_rank, src_md in _source_ranks(source_groups):
        if tuple(src_md.global_shape) != tuple(target.global_shape):
            raise ValueError(
                f"Cannot reshard {fqn or '<item>'}: saved with global shape {tuple(src_md.global_shape)} but the "
                f"target has {tuple(target.global_shape)}. The model changed; load into a matching model."
            )
        src_runs = compute_local_runs(src_md, src_rank)
        key = tuple(tuple(r) for r in src_runs)
        if key in seen or target_numel == 0:
            continue
        seen.add(key)
        per_dim = [_overlaps(t, s) for t, s in zip(target_runs, src_runs, strict=True)]
        elem = torch.empty((), dtype=src_md.torch_dtype).element_size()
        for combo in itertools.product(*per_dim):
            plans.append(
                LoadPlan(
                    offsets=tuple(c[0] for c in combo),
                    sizes=tuple(c[2] for c in combo),
                    src_rank=src_rank,
                    src_fqn=fqn,
                    src_offsets=tuple(c[1] for c in combo),
                    src_sizes=tuple(c[2] for c in combo),
                    src_elem_size=elem,
                    src_dtype=src_md.dtype,
                )
            )
    covered = sum(p.numel for p in plans)
    if covered != target_numel:
        return None
    return plans


def plan_resharding(
    target_metadata: Mapping[NestedPath, ShardingMetadata],
    source_metadata: DistributedItemMetadata,
    rank: int,
) -> ReshardingInfo:
    info = ReshardingInfo()
    for path, target in target_metadata.items():
        groups = source_metadata.nested_path_to_metadata.get(tuple(path))
        if (
            not isinstance(target, DTensorShardingMetadata)
            or not groups
            or not all(isinstance(g.sharding_metadata, DTensorShardingMetadata) for g in groups)
        ):
            info.non_reshardable_paths.append(path)
            continue
        if target.mesh_spec.get_coordinate(rank) is None:
            info.nested_path_to_load_plans[path] = []  # this rank holds no part of the target
            continue
        plans = compute_load_plans(path, target, groups, rank)
        if plans is None:
            info.non_reshardable_paths.append(path)
        else:
            info.nested_path_to_load_plans[path] = plans
    return info


def _current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _resolve(target: Any, path: NestedPath) -> Any:
    node = target
    for comp in path:
        if isinstance(node, Mapping):
            if comp not in node:
                return None
            node = node[comp]
        elif isinstance(node, (list, tuple)) and isinstance(comp, int) and -len(node) <= comp < len(node):
            node = node[comp]
        else:
            return None
    return node


def _local_of(value: Any) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value._local_tensor
    return value if isinstance(value, torch.Tensor) else None


_Copy = tuple[NestedPath, tuple[slice, ...], SourceTensor, LoadPlan]


@dataclass(frozen=True, kw_only=True)
class _ReshardJob:
    """One item's resharding onto one target rank: the plan, where to read, where to write."""

    info: ReshardingInfo
    target: Any
    target_metadata: Mapping[NestedPath, ShardingMetadata]
    source_metadata: DistributedItemMetadata
    source_path: Path
    item_key: str
    storage: Storage
    stats: ReadStats
    rank: int


def _plan_job(
    rank: int,
    source_path: Path,
    item_key: str,
    target_metadata: Mapping[NestedPath, ShardingMetadata],
    source_metadata: DistributedItemMetadata,
    target: Any,
    storage: Storage,
    stats: ReadStats,
) -> _ReshardJob:
    return _ReshardJob(
        info=plan_resharding(target_metadata, source_metadata, rank),
        target=target,
        target_metadata=target_metadata,
        source_metadata=source_metadata,
        source_path=Path(source_path),
        item_key=item_key,
        storage=storage,
        stats=stats,
        rank=rank,
    )


def _collect_copies(job: _ReshardJob) -> tuple[list[_Copy], list[NestedPath]]:
    """Every block copy a load will make, checked (target shapes, source tensors and bounds) before any is made."""
    info, target, target_metadata, source_metadata = job.info, job.target, job.target_metadata, job.source_metadata
    source_path, item_key, storage, stats, rank = job.source_path, job.item_key, job.storage, job.stats, job.rank
    failed: list[NestedPath] = list(info.non_reshardable_paths)
    by_rank: dict[int, list[tuple[NestedPath, LoadPlan]]] = {}
    for path, plans in info.nested_path_to_load_plans.items():
        local = _local_of(_resolve(target, path))
        if local is None:
            failed.append(path)
            continue
        expected, _ = compute_local_shard_info(target_metadata[path], rank)  # type: ignore[arg-type]
        if tuple(local.shape) != expected:
            raise TemplateMismatchError(
                f"Target {item_key}::{dotted_key(path)} has local shape {tuple(local.shape)} but its sharding "
                f"metadata implies {expected}; pass the live DTensor (not a copy or a full tensor) in into="
            )
        for plan in plans:
            by_rank.setdefault(plan.src_rank, []).append((path, plan))
    bad: set[NestedPath] = set()
    copies: list[_Copy] = []
    for src_rank in sorted(by_rank):
        file_path = source_metadata.get_file_path(src_rank, source_path, item_key)
        fmt = source_metadata.get_layout(src_rank, item_key).serialization_format
        source: SourceFile = open_source_file(storage, file_path, fmt, stats)
        for path, plan in by_rank[src_rank]:
            tensor = source.tensor(path)
            if tensor is None:
                bad.add(path)
                continue
            if not _block_fits(plan, tuple(tensor.shape)):
                raise CorruptCheckpointError(
                    f"{file_path} holds {item_key}::{dotted_key(path)} with shape {tuple(tensor.shape)}, which "
                    f"does not match the checkpoint's sharding metadata; the checkpoint is damaged."
                )
            copies.append(
                (path, tuple(slice(o, o + s) for o, s in zip(plan.offsets, plan.sizes, strict=True)), tensor, plan)
            )
    copies = [c for c in copies if c[0] not in bad]
    failed.extend(p for p in info.nested_path_to_load_plans if p in bad)
    return copies, failed


def _block_fits(plan: LoadPlan, shape: tuple[int, ...]) -> bool:
    if not len(plan.src_offsets) == len(plan.src_sizes) == len(shape):
        return False
    return all(o >= 0 and o + n <= size for o, n, size in zip(plan.src_offsets, plan.src_sizes, shape, strict=True))


def _execute_plans(job: _ReshardJob) -> list[NestedPath]:
    """Copy every planned block into the target; returns the paths that could not be filled.

    Every block is located and checked first, so a refused load has copied nothing.
    """
    copies, failed = _collect_copies(job)
    for path, index, tensor, plan in copies:
        block = tensor.read_block(plan.src_offsets, plan.src_sizes, job.stats)
        local = _local_of(_resolve(job.target, path))
        assert local is not None
        local[index].copy_(block)
    return failed


def check_reshard_targets(
    item_key: str,
    target_metadata: dict[NestedPath, ShardingMetadata],
    source_metadata: DistributedItemMetadata,
    target: Any,
    rank: int,
    source_path: Path,
    storage: Storage,
) -> None:
    """Raise what `load` would raise for this target, without copying anything (a load's check phase)."""
    _collect_copies(
        _plan_job(rank, source_path, item_key, target_metadata, source_metadata, target, storage, ReadStats())
    )


class DTensorResharder(Resharder):
    """Reshards DTensor state (Shard, _StridedShard, Replicate; any mesh) and plain tensors.

    Plain tensors are treated as replicated over the job's world. After each `load`,
    `last_load_stats` says which source files were opened and how many bytes were read.
    """

    def __init__(self) -> None:
        self.last_load_stats: ReadStats | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __getstate__(self) -> dict[str, Any]:
        return {"last_load_stats": None}

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[NestedPath, ShardingMetadata]:
        out: dict[NestedPath, ShardingMetadata] = {}
        plain: list[str] = []
        self._walk(item_key, item_value, (), out, plain)
        # Plain tensors are usually deliberate (FSDP2's scalar `step`, templates on one process without a group):
        # say so once per resharder (one per manager's ItemSpec), not on every save and load of every rank.
        said: set[tuple[str, tuple[str, ...]]] = self.__dict__.setdefault("_said", set())
        if plain and (item_key, tuple(plain)) not in said:
            said.add((item_key, tuple(plain)))
            warnings.warn(
                f"Item '{item_key}' has plain (non-DTensor) tensors at {plain[:5]}{' ...' if len(plain) > 5 else ''}; "
                "they are recorded as replicated on every rank and resharded as such (said once per resharder)",
                stacklevel=2,
            )
        return out

    def _walk(
        self, key: str, value: Any, path: NestedPath, out: dict[NestedPath, ShardingMetadata], plain: list[str]
    ) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            out[path] = DTensorShardingMetadata.from_dtensor(value, where=f"at {key}::{dotted_key(path)}")
        elif isinstance(value, torch.Tensor):
            out[path] = DTensorShardingMetadata.replicated(value, _world_size())
            plain.append(dotted_key(path))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                self._walk(key, v, (*path, k), out, plain)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self._walk(key, v, (*path, i), out, plain)

    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: dict[NestedPath, ShardingMetadata],
        source_metadata: DistributedItemMetadata,
        target: Any,
        storage: Storage,
    ) -> list[NestedPath]:
        return self.load_as_rank(
            _current_rank(), source_path, item_key, target_metadata, source_metadata, target, storage
        )

    def load_as_rank(
        self,
        rank: int,
        source_path: Path,
        item_key: str,
        target_metadata: dict[NestedPath, ShardingMetadata],
        source_metadata: DistributedItemMetadata,
        target: Any,
        storage: Storage,
    ) -> list[NestedPath]:
        """`load` for an explicit target rank: lets one process play every rank (tests, offline tools)."""
        stats = ReadStats()
        try:
            job = _plan_job(rank, source_path, item_key, target_metadata, source_metadata, target, storage, stats)
            failed = _execute_plans(job)
        finally:
            self.last_load_stats = stats
        if failed:
            logger.warning("Item %s: could not reshard %s", item_key, [dotted_key(p) for p in failed])
        return failed
