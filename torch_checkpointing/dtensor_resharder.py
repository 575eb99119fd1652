"""Reshard DTensor (and plain tensor) state between any two meshes and placements.

Every rank's local data is, per tensor dimension, an ordered list of contiguous runs of global
indices: one run for `Shard`, several for `_StridedShard`, the whole dimension for `Replicate`.
Intersecting this rank's runs with each source rank's runs, dimension by dimension, gives the
rectangular blocks (`LoadPlan`s) to copy; only those blocks are read from the source files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch

from torch_checkpointing.codecs import dtype_from_name
from torch_checkpointing.distributed_metadata import (
    METADATA_FILE_NAME,
    DistributedItemMetadata,
    ShardingMetadata,
    field_int,
)
from torch_checkpointing.dtensor_metadata import (
    DTensorShardingMetadata,
    ReplicateSpec,
    ShardSpec,
    StridedShardSpec,
)
from torch_checkpointing.errors import ConfigError, ConfigTypeError, CorruptCheckpointError, TemplateMismatchError
from torch_checkpointing.resharding import LoadPlan, Resharder, ReshardingInfo
from torch_checkpointing.source_reader import ReadStats, SourceFile, SourceTensor, open_source_file
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.traversal import (
    any_leaf,
    children,
    dotted_key,
    get_path,
    is_dtensor,
    iter_leaves,
    local_tensor,
)
from torch_checkpointing.types import CheckpointPath, NestedPath
from torch_checkpointing.walk_utils import MISSING, check_shared_targets, check_writable, walk_checkpoint_structure

__all__ = [
    "DTensorResharder",
    "PlanStats",
    "ReshardJob",
    "check_reshard_job",
    "check_saved_shards",
    "compute_load_plans",
    "compute_local_runs",
    "compute_local_shard_info",
    "offering_checked_job",
    "plan_reshard_job",
    "plan_resharding",
    "planned_job_runner",
    "shared_storage_paths",
    "shared_target_copies",
    "target_storages",
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
    for j in range(_nonempty_pieces(sum(n for _, n in segments), split_factor)):
        out.extend(_chunk(_chunk(segments, split_factor, j), num_chunks, index))
    return out


def _nonempty_pieces(total: int, split_factor: int) -> int:
    """How many of torch.chunk's `split_factor` pieces of `total` elements hold any: the later ones are empty,
    so a split factor far above the dimension's size costs no more than the size."""
    if total == 0:
        return 0
    return min(split_factor, -(-total // -(-total // split_factor)))


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
    """Per tensor dimension, the runs of global indices `rank` holds, in local order.

    Arguments of other types are a `ConfigTypeError`: a str rank said "Rank 0 is not in the device mesh", and
    metadata of another kind an AttributeError about `mesh_spec`."""
    if not isinstance(metadata, DTensorShardingMetadata):
        raise ConfigTypeError(
            f"compute_local_shard_info/compute_local_runs needs a DTensorShardingMetadata, got "
            f"{type(metadata).__name__} {metadata!r:.80}"
        )
    rank = field_int(rank, "rank", "compute_local_shard_info/compute_local_runs", minimum=-(1 << 63))
    coord = metadata.mesh_spec.get_coordinate(rank)
    if coord is None:
        raise ConfigError(
            f"Rank {rank} is not in the device mesh {metadata.mesh_spec.mesh_data}; pass a rank the mesh lists"
        )
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


@dataclass
class PlanStats:
    """Work the planner did, in units that do not depend on the machine.

    `chunk_checks` counts the chunks tested against the target block and `sources` the source blocks
    that overlap it: with the indexed planner both follow the overlap, not the number of source ranks.
    """

    chunk_checks: int = 0
    sources: int = 0


def _source_ranks(source_groups: list[Any]) -> list[tuple[int, DTensorShardingMetadata]]:
    ranks: dict[int, DTensorShardingMetadata] = {}
    for group in source_groups:
        md = group.sharding_metadata
        for rank in group.ranks:
            if md.mesh_spec.get_coordinate(rank) is not None:
                ranks.setdefault(rank, md)
    return sorted(ranks.items())


class _GlobalShapeChanged(TemplateMismatchError):
    """The target's global shape differs from the one the sharding metadata records at `nested_path`.

    A changed model, not a layout to reshard; but only once the saved shards are seen to fit the recorded shape
    (`_judge_shape_change`): a crafted or damaged global_shape reads the same from the metadata alone."""

    def __init__(self, message: str, nested_path: NestedPath) -> None:
        super().__init__(message)
        self.nested_path = nested_path


def _check_global_shape(
    nested_path: NestedPath, src_md: DTensorShardingMetadata, target: DTensorShardingMetadata
) -> None:
    if tuple(src_md.global_shape) != tuple(target.global_shape):
        raise _GlobalShapeChanged(
            f"Cannot reshard {dotted_key(nested_path) or '<item>'}: saved with global shape "
            f"{tuple(src_md.global_shape)} but the target has {tuple(target.global_shape)}. The model changed since "
            f"the save; load into a model of the saved shape, or leave this entry out of the template.",
            nested_path,
        )


def _block_plans(
    fqn: str, target_runs: tuple[list[Run], ...], src_rank: int, src_md: DTensorShardingMetadata, src_runs: Any
) -> list[LoadPlan]:
    per_dim = [_overlaps(t, s) for t, s in zip(target_runs, src_runs, strict=True)]
    elem = src_md.torch_dtype.itemsize
    return [
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
        for combo in itertools.product(*per_dim)
    ]


def _numel(runs: tuple[list[Run], ...]) -> int:
    n = 1
    for dim_runs in runs:
        n *= sum(r.length for r in dim_runs)
    return n


def _check_groups_agree(nested_path: NestedPath, groups: list[Any]) -> None:
    """The ranks of one tensor may lay it out differently, but all save the same global tensor: groups that
    disagree on its global shape or dtype are damaged metadata, not a model that changed since the save."""
    first: DTensorShardingMetadata = groups[0].sharding_metadata
    for group in groups[1:]:
        md: DTensorShardingMetadata = group.sharding_metadata
        if (tuple(md.global_shape), md.dtype) != (tuple(first.global_shape), first.dtype):
            where, a, b = dotted_key(nested_path) or "<item>", list(groups[0].ranks[:3]), list(group.ranks[:3])
            raise CorruptCheckpointError(
                f"the sharding metadata of {where} gives ranks {a} a {first.dtype} tensor of global shape "
                f"{tuple(first.global_shape)} and ranks {b} a {md.dtype} one of global shape "
                f"{tuple(md.global_shape)}; one tensor has one global shape and dtype: the metadata is damaged."
            )


def _brute_force_plans(
    nested_path: NestedPath,
    target: DTensorShardingMetadata,
    source_groups: list[Any],
    rank: int,
    stats: PlanStats | None = None,
) -> list[LoadPlan] | None:
    """Every source rank of every group, tested one by one: O(source ranks) per tensor.

    Kept for layouts the indexed planner does not take (several groups for one path, a group missing some
    of its mesh's ranks, a mesh listing a rank twice) and as the reference the indexed planner is tested against.
    """
    target_runs = compute_local_runs(target, rank)
    target_numel = _numel(target_runs)
    fqn = dotted_key(nested_path)
    plans: list[LoadPlan] = []
    seen: set[tuple[tuple[Run, ...], ...]] = set()
    for src_rank, src_md in _source_ranks(source_groups):
        _check_global_shape(nested_path, src_md, target)
        if stats is not None:
            stats.chunk_checks += 1
        src_runs = compute_local_runs(src_md, src_rank)
        key = tuple(tuple(r) for r in src_runs)
        if key in seen or target_numel == 0:
            continue
        seen.add(key)
        block = _block_plans(fqn, target_runs, src_rank, src_md, src_runs)
        if stats is not None and block:
            stats.sources += 1
        plans.extend(block)
    clash = _first_overlap(plans)
    if clash is not None:
        a, b = clash
        raise CorruptCheckpointError(
            f"the sharding metadata of {fqn or '<item>'} has source ranks {a.src_rank} and {b.src_rank} holding "
            f"overlapping, unequal blocks (at target offsets {a.offsets} and {b.offsets}): no save lays a tensor "
            f"out so; the metadata is damaged."
        )
    covered = sum(p.numel for p in plans)
    return plans if covered == target_numel else None


def _unindexed_plans(
    nested_path: NestedPath,
    target: DTensorShardingMetadata,
    source_groups: list[Any],
    rank: int,
    stats: PlanStats,
) -> list[LoadPlan] | None:
    """The first group that fills the target on its own, else every group's ranks pooled.

    Groups that each hold the whole tensor (replica groups on their own sub-meshes, a plain tensor beside a
    DTensor) may cut it at different places: pooled, their blocks overlap unequally, which only damaged
    metadata does within one layout. Each is a complete copy, so one of them is read.
    """
    if len(source_groups) > 1:
        for group in source_groups:
            plans = _brute_force_plans(nested_path, target, [group], rank, stats)
            if plans is not None:
                return plans
    return _brute_force_plans(nested_path, target, source_groups, rank, stats)


def _first_overlap(plans: list[LoadPlan]) -> tuple[LoadPlan, LoadPlan] | None:
    """Two plans writing one target element, if any. Counting covered elements is no proof of a cover: an
    overlap hides a gap of its size. A sweep along the dimension with the most distinct block starts, so
    a tiling compares each block with the few that share its stripe, not with all of them."""
    if len(plans) < 2:
        return None
    ndim = len(plans[0].offsets)
    if ndim == 0:
        return plans[0], plans[1]
    axis = max(range(ndim), key=lambda d: len({p.offsets[d] for p in plans}))
    active: list[LoadPlan] = []
    for plan in sorted(plans, key=lambda p: p.offsets[axis]):
        start = plan.offsets[axis]
        active = [a for a in active if a.offsets[axis] + a.sizes[axis] > start]
        for other in active:
            if all(
                o < p + n and p < o + m
                for o, m, p, n in zip(other.offsets, other.sizes, plan.offsets, plan.sizes, strict=True)
            ):
                return other, plan
        active.append(plan)
    return None


def _indexable(
    source_groups: list[Any], known: dict[tuple[int, int], bool] | None = None
) -> DTensorShardingMetadata | None:
    """The one source layout when a single group holds every rank of its (duplicate-free) mesh, else None.

    `known` remembers the answer per (rank list, mesh) object pair for the length of one planning call:
    every tensor of a model repeats the same two objects, and comparing them costs O(world).
    """
    if len(source_groups) != 1:
        return None
    group = source_groups[0]
    md = group.sharding_metadata
    if not isinstance(md, DTensorShardingMetadata):
        return None
    mesh, ranks = md.mesh_spec, group.ranks
    key = (id(ranks), id(mesh))
    covers = None if known is None else known.get(key)
    if covers is None:
        covers = len(mesh.coordinates()) == len(mesh.mesh_data) and (
            ranks is mesh.mesh_data or ranks == mesh.mesh_data or set(mesh.mesh_data) <= set(ranks)
        )
        if known is not None:
            known[key] = covers
    return md if covers else None


def _local_hits(segments: _Segments, target: list[Run]) -> list[tuple[int, int]]:
    """Local [lo, hi) positions of `segments` whose global indices the target runs hold."""
    out = []
    pos = 0
    for g, n in segments:
        for t in target:
            lo, hi = max(g, t.global_start), min(g + n, t.global_start + t.length)
            if lo < hi:
                out.append((pos + lo - g, pos + hi - g))
        pos += n
    return out


def _chunks_hit(hits: list[tuple[int, int]], base: int, length: int, k: int, out: set[int]) -> int:
    """Add to `out` the indices of the k torch.chunk pieces of local range [base, base + length) that `hits`
    touch; returns the number of hit ranges tested."""
    size = -(-length // k)
    for lo, hi in hits:
        a, b = max(lo, base), min(hi, base + length)
        if a < b:
            out.update(range((a - base) // size, (b - 1 - base) // size + 1))
    return len(hits)


def _overlapping_chunks(
    segments: _Segments, placement: ShardSpec | StridedShardSpec, k: int, target: list[Run], stats: PlanStats
) -> list[int]:
    """The mesh coordinates (0..k-1) along one mesh dimension whose piece of `segments` meets the target.

    Computed from the chunk sizes (division, not a scan of the k pieces), so the cost follows the overlap.
    """
    hits = _local_hits(segments, target)
    total = sum(n for _, n in segments)
    found: set[int] = set()
    if isinstance(placement, StridedShardSpec):
        piece = -(-total // placement.split_factor)
        for j in range(_nonempty_pieces(total, placement.split_factor)):
            lo, hi = min(j * piece, total), min((j + 1) * piece, total)
            if lo < hi:
                stats.chunk_checks += _chunks_hit(hits, lo, hi - lo, k, found)
    elif total:
        stats.chunk_checks += _chunks_hit(hits, 0, total, k, found)
    stats.chunk_checks += len(found)
    return sorted(found)


_Leaf = tuple[tuple[int | None, ...], list[_Segments]]


def _overlapping_blocks(
    md: DTensorShardingMetadata, target_runs: tuple[list[Run], ...], stats: PlanStats
) -> list[_Leaf]:
    """(mesh coordinate, per-dim segments) of every source block meeting the target; None marks a Replicate dim.

    A depth-first walk over the mesh dimensions that only descends into pieces meeting the target.
    """
    leaves: list[_Leaf] = []
    shape = md.mesh_spec.mesh_shape

    def visit(level: int, segments: list[_Segments], coord: tuple[int | None, ...]) -> None:
        if level == len(md.placements):
            leaves.append((coord, segments))
            return
        placement = md.placements[level]
        if isinstance(placement, ReplicateSpec):
            visit(level + 1, segments, (*coord, None))
            return
        if not isinstance(placement, ShardSpec | StridedShardSpec):
            raise ValueError(f"Unsupported placement {placement!r} in sharding metadata")
        d, k = placement.dim, shape[level]
        for c in _overlapping_chunks(segments[d], placement, k, target_runs[d], stats):
            piece = (
                _strided_chunk(segments[d], placement.split_factor, k, c)
                if isinstance(placement, StridedShardSpec)
                else _chunk(segments[d], k, c)
            )
            visit(level + 1, [*segments[:d], piece, *segments[d + 1 :]], (*coord, c))

    visit(0, [[(0, n)] for n in md.global_shape], ())
    return leaves


def _replica_owner(md: DTensorShardingMetadata, coord: tuple[int | None, ...]) -> int:
    """The lowest rank holding the block at `coord` (None: any coordinate along that Replicate dimension)."""
    mesh = md.mesh_spec
    free = tuple(i for i, c in enumerate(coord) if c is None)
    if not free:
        flat = 0
        for c, n in zip(coord, mesh.mesh_shape, strict=True):
            flat = flat * n + int(c)  # type: ignore[arg-type]
        return mesh.mesh_data[flat]
    tables = mesh._derived().setdefault("replica_owner", {})
    table = tables.get(free)
    if table is None:
        table = {}
        for rank, full in mesh.coordinates().items():
            key = tuple(None if i in free else c for i, c in enumerate(full))
            if rank < table.get(key, rank + 1):
                table[key] = rank
        tables[free] = table
    owner: int = table[coord]
    return owner


def _indexed_plans(
    nested_path: NestedPath,
    target: DTensorShardingMetadata,
    src_md: DTensorShardingMetadata,
    rank: int,
    stats: PlanStats,
) -> list[LoadPlan] | None:
    fqn = dotted_key(nested_path)
    _check_global_shape(nested_path, src_md, target)
    target_runs = compute_local_runs(target, rank)
    target_numel = _numel(target_runs)
    if target_numel == 0:
        return []
    blocks = sorted(
        (_replica_owner(src_md, coord), segments) for coord, segments in _overlapping_blocks(src_md, target_runs, stats)
    )
    plans: list[LoadPlan] = []
    for src_rank, segments in blocks:
        stats.sources += 1
        plans.extend(_block_plans(fqn, target_runs, src_rank, src_md, tuple(_to_runs(s) for s in segments)))
    covered = sum(p.numel for p in plans)
    return plans if covered == target_numel else None


def compute_load_plans(
    nested_path: NestedPath,
    target: DTensorShardingMetadata,
    source_groups: list[Any],
    rank: int,
    stats: PlanStats | None = None,
) -> list[LoadPlan] | None:
    """Plans filling `rank`'s local shard of `target` from the source ranks; None if they cannot cover it.

    Source ranks holding identical index sets (replicas) are read once, from the lowest rank. When one
    group holds every rank of its mesh (every real save) only the source blocks meeting the target are
    visited, found by division along each mesh dimension: the work per target rank follows how many source
    blocks it overlaps, not how many source ranks there are.
    """
    stats = stats if stats is not None else PlanStats()
    src_md = _indexable(source_groups)
    if src_md is None:
        return _unindexed_plans(nested_path, target, source_groups, rank, stats)
    return _indexed_plans(nested_path, target, src_md, rank, stats)


def plan_resharding(
    target_metadata: Mapping[NestedPath, ShardingMetadata],
    source_metadata: DistributedItemMetadata,
    rank: int,
    stats: PlanStats | None = None,
) -> ReshardingInfo:
    """One item's plans for one target rank; `stats` (if given) accumulates the planner's work.

    Every call plans afresh and keeps nothing: a load plans each item once (`plan_reshard_job`) and hands
    that job from its check phase to its copy phase.
    """
    return _plan(target_metadata, source_metadata, rank, stats if stats is not None else PlanStats())


def _plan(
    target_metadata: Mapping[NestedPath, ShardingMetadata],
    source_metadata: DistributedItemMetadata,
    rank: int,
    stats: PlanStats,
) -> ReshardingInfo:
    info = ReshardingInfo()
    # Tensors with equal target and source layouts (every layer of a transformer) get the same blocks; only
    # the name differs, so each distinct pair is planned once per call.
    same_layout: dict[tuple[DTensorShardingMetadata, DTensorShardingMetadata], list[LoadPlan] | None] = {}
    covering: dict[tuple[int, int], bool] = {}
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
        plans = _plan_path(path, target, groups, rank, stats, same_layout, covering)
        if plans is None:
            info.non_reshardable_paths.append(path)
        else:
            info.nested_path_to_load_plans[path] = plans
    return info


def _plan_path(
    path: NestedPath,
    target: DTensorShardingMetadata,
    groups: list[Any],
    rank: int,
    stats: PlanStats,
    same_layout: dict[tuple[DTensorShardingMetadata, DTensorShardingMetadata], list[LoadPlan] | None],
    covering: dict[tuple[int, int], bool],
) -> list[LoadPlan] | None:
    src_md = _indexable(groups, covering)
    if src_md is None:
        _check_groups_agree(path, groups)
        return _unindexed_plans(path, target, groups, rank, stats)
    key = (target, src_md)
    if key not in same_layout:
        same_layout[key] = _indexed_plans(path, target, src_md, rank, stats)
        return same_layout[key]
    known = same_layout[key]
    fqn = dotted_key(path)
    if known is None:
        return None
    return [dataclasses.replace(p, src_fqn=fqn) for p in known]


def _current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _local_of(value: Any) -> torch.Tensor | None:
    return local_tensor(value) if isinstance(value, torch.Tensor) else None


_Copy = tuple[NestedPath, tuple[slice, ...], SourceTensor, LoadPlan]


@dataclass(frozen=True, kw_only=True)
class ReshardJob:
    """One item's resharding onto one target rank, planned once per load.

    A load's check phase verifies every block of `info` and its copy phase copies exactly those blocks, so
    what is copied is what was checked, and the (at scale, costly) planning runs once.
    """

    info: ReshardingInfo
    target: Any
    target_metadata: Mapping[NestedPath, ShardingMetadata]
    source_metadata: DistributedItemMetadata
    source_path: Path
    item_key: str
    rank: int
    # The target's entries that hold no tensor (an optimizer's param_groups, counters): not sharded, so the
    # same on every rank, and restored whole from one source rank's file: the first one the plans read.
    values: tuple[NestedPath, ...] = ()
    values_rank: int | None = None
    # What the check phase read for the copy phase (at most one entry; a list, as the job is frozen).
    prepared: list[_Prepared] = dataclasses.field(default_factory=list, compare=False, repr=False)
    # A target of another global shape than the metadata records: the job only reads the saved shards to tell a
    # changed model from damaged metadata, and refuses (`_judge_shape_change`).
    shape_changed: _GlobalShapeChanged | None = None

    @property
    def source_ranks(self) -> list[int]:
        """The source ranks whose files the job reads."""
        if self.shape_changed is not None:
            return [rank for rank, _ in _judged_shards(self, self.shape_changed.nested_path)]
        return sorted(self._read_ranks)

    @functools.cached_property
    def _read_ranks(self) -> set[int]:
        ranks = {p.src_rank for plans in self.info.nested_path_to_load_plans.values() for p in plans}
        return ranks if self.values_rank is None else {*ranks, self.values_rank}

    @functools.cached_property
    def not_received(self) -> list[NestedPath]:
        """The paths the metadata records that no target entry receives (what a strict load refuses as not in the
        template), in the metadata's order."""
        received, covered = set(self.target_metadata), set(self.values)
        return [
            tuple(path)
            for path in self.source_metadata.nested_path_to_metadata
            if tuple(path) not in received and not any(path[:n] in covered for n in range(1, len(path) + 1))
        ]

    def holder_of(self, path: NestedPath) -> int | None:
        """The source rank whose file is checked to hold `path` (`_refuse_unsaved`): one with a place in its mesh
        (a shard) that the job reads anyway; None where there is none (no file is opened only for the check: a
        rank's template that leaves out other stages' tensors would open every other rank's file)."""
        ranks: set[int] = set()
        for group in self.source_metadata.nested_path_to_metadata[path]:
            md = group.sharding_metadata
            if isinstance(md, DTensorShardingMetadata):
                read = self._read_ranks.intersection(group.ranks)
                ranks.update(rank for rank in read if md.mesh_spec.get_coordinate(rank) is not None)
        return min(ranks) if ranks else None


def plan_reshard_job(
    rank: int,
    source_path: Path,
    item_key: str,
    target_metadata: Mapping[NestedPath, ShardingMetadata],
    source_metadata: DistributedItemMetadata,
    target: Any,
) -> ReshardJob:
    """Plan filling `target` (rank `rank`'s templates of one item) from the checkpoint at `source_path`."""
    job = functools.partial(
        ReshardJob,
        target=target,
        target_metadata=target_metadata,
        source_metadata=source_metadata,
        source_path=Path(source_path),
        item_key=item_key,
        rank=rank,
    )
    try:
        info = plan_resharding(target_metadata, source_metadata, rank)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{Path(source_path) / METADATA_FILE_NAME}: item '{item_key}': {exc}") from None
    except _GlobalShapeChanged as exc:  # judged once the saved shards can be read
        return job(info=ReshardingInfo(), shape_changed=exc)
    except TemplateMismatchError as exc:
        raise TemplateMismatchError(f"Checkpoint {source_path}, item '{item_key}': {exc}") from None
    values = tuple(_value_entries(target))
    planned = sorted({p.src_rank for plans in info.nested_path_to_load_plans.values() for p in plans})
    ranks = planned or sorted(source_metadata.rank_to_layout_info)  # a rank that reads no block: any file
    return job(info=info, values=values, values_rank=ranks[0] if values and ranks else None)


def _value_entries(node: Any, path: NestedPath = ()) -> Iterator[NestedPath]:
    """The entries of `node`'s containers that hold no tensor, outermost first (a tensor-free dict is one)."""
    for key, child in children(node):
        here = (*path, key)
        if not any_leaf(child, _is_tensor):
            yield here
        else:
            yield from _value_entries(child, here)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


@dataclass
class _Collected:
    """What a job will do, every piece checked: the block copies, the non-tensor values, the paths it cannot fill."""

    copies: list[_Copy]
    values: list[tuple[NestedPath, Any]]
    failed: list[NestedPath]
    # Each copied path's target tensor (its local shard), for the shared-memory check.
    targets: dict[NestedPath, torch.Tensor] = dataclasses.field(default_factory=dict)


def _collect(job: ReshardJob, storage: Storage, stats: ReadStats) -> _Collected:
    """Everything a load will write into the target, checked before anything is: the block copies (target
    shapes, source tensors and bounds) and the non-tensor values (present, tensor-free, of the template's types)."""
    opened: dict[int, SourceFile] = {}

    def source_of(src_rank: int) -> SourceFile:
        if src_rank not in opened:
            file_path = job.source_metadata.get_file_path(src_rank, job.source_path, job.item_key)
            fmt = job.source_metadata.get_layout(src_rank, job.item_key).serialization_format
            opened[src_rank] = open_source_file(storage, file_path, fmt, stats)
        return opened[src_rank]

    _refuse_unsaved(job, source_of)
    copies, failed, targets = _collect_copies(job, source_of)
    values: list[tuple[NestedPath, Any]] = []
    if job.values_rank is not None:
        values, unfilled = _collect_values(job, source_of(job.values_rank))
        failed.extend(unfilled)
    return _Collected(copies, values, failed, targets)


def _refuse_unsaved(job: ReshardJob, source_of: Callable[[int], SourceFile]) -> None:
    """Refuse (naming metadata.json) a path the metadata records, no target entry receives, and the file of a rank
    it lists does not hold: a strict load reported it as in the checkpoint but not in the template, blaming the
    caller's model for what only a damaged or crafted metadata.json holds. Paths the target receives are checked
    by their copies."""
    for path in job.not_received:
        rank = job.holder_of(path)
        if rank is not None and source_of(rank).tensor(path) is None:
            raise CorruptCheckpointError(
                f"{job.source_path / METADATA_FILE_NAME} is damaged or crafted: it records "
                f"{job.item_key}::{dotted_key(path)} as a tensor of rank {rank}, but "
                f"{job.source_metadata.get_file_path(rank, job.source_path, job.item_key)} holds no such tensor. "
                f"Nothing was loaded; load an intact checkpoint."
            )


def _collect_values(job: ReshardJob, source: SourceFile) -> tuple[list[tuple[NestedPath, Any]], list[NestedPath]]:
    """Each tensor-free entry of the target with the saved value that replaces it, type-checked (a dry run of
    the merge); entries the source lacks, holds tensors at, or that sit in an immutable container are unfilled."""
    values: list[tuple[NestedPath, Any]] = []
    unfilled: list[NestedPath] = []
    for path in job.values:
        saved, parent = source.entry(path), get_path(job.target, path[:-1])
        if saved is MISSING or any_leaf(saved, _is_tensor) or not isinstance(parent, (MutableMapping, list)):
            unfilled.append(path)
            continue
        _, missing = walk_checkpoint_structure(
            item_key=job.item_key, source=saved, target=get_path(job.target, path), dry_run=True, at=path
        )
        unfilled.extend(tuple(m.nested_path) for m in missing)
        values.append((path, saved))
    return values, unfilled


def _collect_copies(
    job: ReshardJob, source_of: Callable[[int], SourceFile]
) -> tuple[list[_Copy], list[NestedPath], dict[NestedPath, torch.Tensor]]:
    """Every block copy a load will make, checked (target shapes, source tensors and bounds) before any is made,
    with each copied path's target tensor."""
    info, target, target_metadata, source_metadata = job.info, job.target, job.target_metadata, job.source_metadata
    source_path, item_key, rank = job.source_path, job.item_key, job.rank
    failed: list[NestedPath] = list(info.non_reshardable_paths)
    targets: dict[NestedPath, torch.Tensor] = {}
    by_rank: dict[int, list[tuple[NestedPath, LoadPlan]]] = {}
    for path, plans in info.nested_path_to_load_plans.items():
        local = _local_of(get_path(target, path))
        if local is None:
            failed.append(path)
            continue
        expected, _ = compute_local_shard_info(target_metadata[path], rank)  # type: ignore[arg-type]
        if tuple(local.shape) != expected:
            raise TemplateMismatchError(
                f"Target {item_key}::{dotted_key(path)} has local shape {tuple(local.shape)} but its sharding "
                f"metadata implies {expected}; pass the live DTensor (not a copy or a full tensor) in into="
            )
        check_writable(f"{item_key}::{dotted_key(path)}", local)
        targets[path] = local
        for plan in plans:
            by_rank.setdefault(plan.src_rank, []).append((path, plan))
    bad: set[NestedPath] = set()
    copies: list[_Copy] = []
    saved_shapes: dict[tuple[int, int], tuple[int, ...]] = {}
    for src_rank in sorted(by_rank):
        file_path = source_metadata.get_file_path(src_rank, source_path, item_key)
        source = source_of(src_rank)
        for path, plan in by_rank[src_rank]:
            tensor = source.tensor(path)
            if tensor is None:
                bad.add(path)
                continue
            expected_shape = _saved_shape(job, path, src_rank, saved_shapes)
            if tuple(tensor.shape) != expected_shape or not _block_fits(plan, tuple(tensor.shape)):
                raise CorruptCheckpointError(
                    f"{file_path} holds {item_key}::{dotted_key(path)} with shape {tuple(tensor.shape)}, but the "
                    f"checkpoint's sharding metadata gives rank {src_rank} a {expected_shape} piece of it; the "
                    f"checkpoint is damaged."
                )
            recorded = dtype_from_name(plan.src_dtype)
            if recorded is not None and tensor.dtype != recorded:
                raise CorruptCheckpointError(
                    f"{file_path} holds {item_key}::{dotted_key(path)} as {tensor.dtype}, but the checkpoint's "
                    f"sharding metadata records {plan.src_dtype}; the checkpoint is damaged."
                )
            if tensor.dtype != targets[path].dtype:  # a direct load refuses it too: copy_() would convert silently
                raise TemplateMismatchError(
                    f"Cannot reshard {item_key}::{dotted_key(path)}: saved as {tensor.dtype} but the target is "
                    f"{targets[path].dtype}; a load does not convert dtypes. Load into a template of the saved dtype "
                    f"and convert it afterwards (e.g. model.to(dtype)), or leave this entry out of the template."
                )
            copies.append(
                (path, tuple(slice(o, o + s) for o, s in zip(plan.offsets, plan.sizes, strict=True)), tensor, plan)
            )
    copies = [c for c in copies if c[0] not in bad]
    failed.extend(p for p in info.nested_path_to_load_plans if p in bad)
    return copies, failed, {p: t for p, t in targets.items() if p not in bad}


def _saved_shape(
    job: ReshardJob, path: NestedPath, src_rank: int, known: dict[tuple[int, int], tuple[int, ...]]
) -> tuple[int, ...]:
    """The local shape the sharding metadata gives `src_rank`'s piece of `path`: its file must hold exactly that
    (a larger tensor would be read at offsets computed for another one). `known` caches it per layout object."""
    groups = job.source_metadata.nested_path_to_metadata[tuple(path)]
    md = next(g.sharding_metadata for g in groups if len(groups) == 1 or src_rank in g.ranks)
    assert isinstance(md, DTensorShardingMetadata)  # _plan plans DTensor layouts only
    key = (id(md), src_rank)
    if key not in known:
        known[key] = compute_local_shard_info(md, src_rank)[0]
    return known[key]


def _block_fits(plan: LoadPlan, shape: tuple[int, ...]) -> bool:
    if not len(plan.src_offsets) == len(plan.src_sizes) == len(shape):
        return False
    return all(o >= 0 and o + n <= size for o, n, size in zip(plan.src_offsets, plan.src_sizes, shape, strict=True))


@dataclass
class _Prepared:
    """A job's checked copies, with the blocks already fetched from a store (by index into `copies`)."""

    collected: _Collected
    fetched: dict[int, torch.Tensor]
    stats: ReadStats


def _prepare(job: ReshardJob, storage: Storage, stats: ReadStats) -> _Prepared:
    """Check every copy, and fetch every block that is a request to a store: a store can fail, or serve
    another object, between two requests, and a block copied before such a failure would leave the target
    half restored. Blocks of open files (memory maps) are views, read in the copy itself."""
    if job.shape_changed is not None:
        _judge_shape_change(job, job.shape_changed, storage, stats)
    collected = _collect(job, storage, stats)
    fetched = {
        i: tensor.read_block(plan.src_offsets, plan.src_sizes, stats)
        for i, (_, _, tensor, plan) in enumerate(collected.copies)
        if tensor.reads_on_demand
    }
    return _Prepared(collected, fetched, stats)


def _judged_shards(job: ReshardJob, path: NestedPath) -> list[tuple[int, DTensorShardingMetadata]]:
    """One source rank of each layout group of `path` (its lowest with a place in its mesh) with its metadata:
    one shard per group tells whether the saved shards fit the global shape that group records."""
    judged: list[tuple[int, DTensorShardingMetadata]] = []
    for group in job.source_metadata.nested_path_to_metadata.get(tuple(path), []):
        md = group.sharding_metadata
        if not isinstance(md, DTensorShardingMetadata):  # planned only when every group's is (`_plan`)
            continue
        rank = next((r for r in group.ranks if md.mesh_spec.get_coordinate(r) is not None), None)
        if rank is not None:
            judged.append((rank, md))
    return judged


def _judge_shape_change(job: ReshardJob, changed: _GlobalShapeChanged, storage: Storage, stats: ReadStats) -> NoReturn:
    """Refuse a target whose global shape differs from the recorded one: as damaged metadata (naming metadata.json)
    when a saved shard does not have the shape the recorded global shape gives its rank, else as a changed model.
    From the metadata alone the two read the same, and a crafted global_shape blamed the caller's model."""
    path, where = changed.nested_path, f"{job.item_key}::{dotted_key(changed.nested_path)}"
    for rank, md in _judged_shards(job, path):
        file_path = job.source_metadata.get_file_path(rank, job.source_path, job.item_key)
        fmt = job.source_metadata.get_layout(rank, job.item_key).serialization_format
        tensor = open_source_file(storage, file_path, fmt, stats).tensor(path)
        expected = compute_local_shard_info(md, rank)[0]
        held = None if tensor is None else tuple(tensor.shape)
        if held != expected:
            raise CorruptCheckpointError(
                f"{job.source_path / METADATA_FILE_NAME} is damaged or crafted: it records {where} as a tensor of "
                f"global shape {tuple(md.global_shape)}, which gives rank {rank} a {expected} shard, but "
                f"{file_path} holds {'no such tensor' if held is None else held}; the saved shards do not fit the "
                f"global shape it records. Nothing was loaded; load an intact checkpoint."
            )
    raise TemplateMismatchError(f"Checkpoint {job.source_path}, item '{job.item_key}': {changed}") from None


def check_saved_shards(root: Path, item_key: str, source: DistributedItemMetadata, rank: int, value: Any) -> None:
    """Refuse (naming metadata.json) a tensor of `rank`'s own file, decoded as `value`, that is not the shard its
    recorded global shape, dtype and placements give `rank`.

    A load whose template has the recorded layout reads the file directly and compares its tensors with the
    template: a crafted global_shape or dtype, and a template built to it, was a TemplateMismatchError blaming
    the model."""
    expected: dict[DTensorShardingMetadata, tuple[tuple[int, ...], str]] = {}
    for path, leaf in iter_leaves(value):
        groups = source.nested_path_to_metadata.get(tuple(path)) if isinstance(leaf, torch.Tensor) else None
        md = next((g.sharding_metadata for g in groups or () if rank in g.ranks), None)
        if not isinstance(md, DTensorShardingMetadata) or md.mesh_spec.get_coordinate(rank) is None:
            continue
        if md not in expected:
            expected[md] = (compute_local_shard_info(md, rank)[0], md.dtype)
        local = local_tensor(leaf)
        held = (tuple(local.shape), str(local.dtype))
        if held != expected[md]:
            raise CorruptCheckpointError(
                f"{Path(root) / METADATA_FILE_NAME} is damaged or crafted: it records {item_key}::{dotted_key(path)} "
                f"as a {md.dtype} tensor of global shape {tuple(md.global_shape)}, which gives rank {rank} a "
                f"{expected[md][0]} {md.dtype} shard, but that rank's file holds a {held[0]} {held[1]} one; the saved "
                f"shards do not fit what it records. Nothing was loaded; load an intact checkpoint."
            )


def _check_tied_targets(job: ReshardJob, prepared: _Prepared) -> None:
    """Refuse (`TemplateMismatchError` naming both paths) target tensors sharing memory (tied weights,
    overlapping views) that the job would fill with different values: the last copy would win, silently.
    Run before any copy, after the blocks are verified; costs one dict operation per target without sharing."""
    paths = shared_storage_paths(prepared.collected.targets, set())
    if paths:
        check_shared_targets(_assembled_copies(job, prepared, paths))


def shared_target_copies(job: ReshardJob, others: set[int]) -> list[tuple[CheckpointPath, torch.Tensor, torch.Tensor]]:
    """For a checked job (`check_reshard_job`): `(where, what the load writes, target)`, in
    `walk_utils.check_shared_targets`' form, for each target whose storage another of its targets or one of
    `others` (storage addresses of other items' targets) uses; [] when none does, the common case."""
    if not job.prepared:
        return []
    prepared = job.prepared[0]
    paths = shared_storage_paths(prepared.collected.targets, others)
    return _assembled_copies(job, prepared, paths) if paths else []


def target_storages(job: ReshardJob) -> list[int]:
    """The storage addresses of the target tensors a checked job copies into (for a check across items)."""
    targets = job.prepared[0].collected.targets if job.prepared else {}
    return [t.untyped_storage().data_ptr() for t in targets.values()]


def shared_storage_paths(targets: Mapping[NestedPath, torch.Tensor], others: set[int]) -> list[NestedPath]:
    """The paths whose target tensor's storage another target of `targets` uses too, or one of `others`
    (storage addresses of other items' targets): the only ones the shared-memory check must look at, found
    with one dict operation per tensor."""
    by_storage: dict[int, list[NestedPath]] = {}
    for path, target in targets.items():
        address = target.untyped_storage().data_ptr()
        if address:  # no memory (empty, meta): nothing to share
            by_storage.setdefault(address, []).append(path)
    return [p for address, paths in by_storage.items() if len(paths) > 1 or address in others for p in paths]


def _assembled_copies(
    job: ReshardJob, prepared: _Prepared, paths: list[NestedPath]
) -> list[tuple[CheckpointPath, torch.Tensor, torch.Tensor]]:
    """`(where, what the load writes, target)` for each of `paths`: each target's values assembled, off the
    template, from the blocks the job copies into it (a store's blocks as fetched, a file's read here)."""
    wanted = set(paths)
    assembled = {p: torch.empty_like(t) for p, t in prepared.collected.targets.items() if p in wanted}
    with torch.no_grad():
        for i, (path, index, tensor, plan) in enumerate(prepared.collected.copies):
            if path in assembled:
                block = prepared.fetched.get(i)
                if block is None:
                    block = tensor.read_block(plan.src_offsets, plan.src_sizes, prepared.stats)
                assembled[path][index].copy_(block)
    return [
        (CheckpointPath(job.item_key, p), assembled[p], prepared.collected.targets[p]) for p in paths if p in assembled
    ]


def _execute_plans(job: ReshardJob, storage: Storage, stats: ReadStats) -> list[NestedPath]:
    """Copy every planned block into the target; returns the paths that could not be filled.

    Every block is located and checked first, and every block from a store fetched, so a refused load
    has copied nothing.
    """
    if job.prepared:
        prepared = job.prepared.pop()  # checked by `check_reshard_job`, tied targets included
    else:
        prepared = _prepare(job, storage, stats)
        _check_tied_targets(job, prepared)
    if prepared.stats is not stats:  # read by the check phase: counted in this load's statistics
        stats.files_opened.extend(prepared.stats.files_opened)
        stats.blocks_read += prepared.stats.blocks_read
        stats.bytes_read += prepared.stats.bytes_read
    collected = prepared.collected
    with torch.no_grad():  # a target may require grad (an nn.Parameter): filled in place, as a direct load does
        for i, (path, index, tensor, plan) in enumerate(collected.copies):
            block = prepared.fetched.pop(i, None)
            if block is None:
                block = tensor.read_block(plan.src_offsets, plan.src_sizes, stats)
            local = _local_of(get_path(job.target, path))
            assert local is not None
            local[index].copy_(block)
    for path, saved in collected.values:
        merged, _ = walk_checkpoint_structure(
            item_key=job.item_key, source=saved, target=get_path(job.target, path), at=path
        )
        get_path(job.target, path[:-1])[path[-1]] = merged
    return collected.failed


def check_reshard_job(job: ReshardJob, storage: Storage) -> list[NestedPath]:
    """Raise what running `job` would raise, without copying anything (a load's check phase); returns the
    paths it cannot fill.

    Every planned source block is checked against the recorded block checksums here, so a damaged block is
    found before the first copy into any target (the copy phase then reads blocks already checked). Blocks a
    store serves are fetched here and handed to the copy phase, so a store failing after this leaves no target
    half restored, and on several ranks the load's agreement makes every rank refuse it.
    """
    prepared = _prepare(job, storage, ReadStats())
    for i, (_, _, tensor, plan) in enumerate(prepared.collected.copies):
        if i not in prepared.fetched:  # a fetched block was checked as it was read
            tensor.check_block(plan.src_offsets, plan.src_sizes)
    _check_tied_targets(job, prepared)
    job.prepared[:] = [prepared]
    return prepared.collected.failed


# The job a load's check phase planned and checked for a subclass whose own `load` the engine calls: offered to
# `DTensorResharder.load`/`load_as_rank` when that `load` calls it with the same arguments, so its blocks (checked,
# and on a store fetched, before the first copy) are neither planned, fetched nor checked again.
_CHECKED_JOB: ContextVar[ReshardJob | None] = ContextVar("torch_checkpointing_checked_job", default=None)


@contextlib.contextmanager
def offering_checked_job(job: ReshardJob) -> Iterator[None]:
    """Within this block, a `load_as_rank` call for exactly `job`'s item, rank, target and metadata runs `job`."""
    token = _CHECKED_JOB.set(job)
    try:
        yield
    finally:
        _CHECKED_JOB.reset(token)


def _checked_job(
    rank: int,
    source_path: Path,
    item_key: str,
    target_metadata: Mapping[NestedPath, ShardingMetadata],
    source_metadata: DistributedItemMetadata,
    target: Any,
) -> ReshardJob | None:
    """The offered job, once, if it was planned for these very arguments (the same objects)."""
    job = _CHECKED_JOB.get()
    if job is None or not job.prepared:
        return None
    if (job.rank, job.item_key, job.source_path) != (rank, item_key, Path(source_path)):
        return None
    if job.target is not target or job.source_metadata is not source_metadata:
        return None
    if job.target_metadata is not target_metadata:
        return None
    _CHECKED_JOB.set(None)  # a second call plans (and checks) its own
    return job


def planned_job_runner(resharder: Resharder) -> DTensorResharder | None:
    """`resharder` if a planned job may stand in for its `load` call, else None.

    That holds when its `load` and `load_as_rank` (which `load` calls) are DTensorResharder's own; a user's
    override of either (on the class or the instance) must be called, so it gets None.
    """
    if not isinstance(resharder, DTensorResharder):
        return None
    for name in ("load", "load_as_rank"):
        if getattr(getattr(resharder, name), "__func__", None) is not getattr(DTensorResharder, name):
            return None
    return resharder


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
        for path, leaf in iter_leaves(item_value):
            if is_dtensor(leaf):
                out[path] = DTensorShardingMetadata.from_dtensor(leaf, where=f"at {item_key}::{dotted_key(path)}")
            elif isinstance(leaf, torch.Tensor):
                out[path] = DTensorShardingMetadata.replicated(leaf, _world_size())
                plain.append(dotted_key(path))
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
        job = _checked_job(rank, source_path, item_key, target_metadata, source_metadata, target)
        if job is None:
            job = plan_reshard_job(rank, source_path, item_key, target_metadata, source_metadata, target)
        return self.load_planned(job, storage)

    def load_planned(self, job: ReshardJob, storage: Storage) -> list[NestedPath]:
        """Run a job `plan_reshard_job` planned (a load's check phase already verified its blocks)."""
        stats = ReadStats()
        try:
            failed = _execute_plans(job, storage, stats)
        finally:
            self.last_load_stats = stats
        if failed:
            logger.warning("Item %s: could not reshard %s", job.item_key, [dotted_key(p) for p in failed])
        return failed
