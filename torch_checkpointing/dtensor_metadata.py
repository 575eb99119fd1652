"""Sharding metadata of one DTensor: global shape, dtype, device mesh and placements.

Kept free of live process-group objects so it pickles (all_gather_object) and
serialises to JSON (metadata.json) the same way on every rank.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torch_checkpointing.codecs import dtype_from_name
from torch_checkpointing.config import integer_as_int
from torch_checkpointing.distributed_metadata import (
    JSON_ARRAY,
    ShardingMetadata,
    decode_rank_list,
    encode_rank_list,
    field_int,
    field_ints,
    json_field,
    json_object,
)
from torch_checkpointing.errors import (
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    TemplateMismatchError,
    unknown_to_this_engine,
)
from torch_checkpointing.manifest import MAX_WORLD_SIZE
from torch_checkpointing.traversal import dotted_key, is_dtensor, iter_leaves

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "DTensorShardingMetadata",
    "DeviceMeshSpec",
    "PlacementSpec",
    "ReplicateSpec",
    "ShardSpec",
    "StridedShardSpec",
    "get_device_mesh_spec",
    "placement_spec_from_dict",
    "refuse_partial_targets",
]


class PlacementSpec(ABC):
    """A DTensor placement reduced to plain data."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored in metadata.json: `{"type": ..., **fields}`."""

    @classmethod
    @abstractmethod
    def from_dict(cls, d: dict[str, Any]) -> PlacementSpec:
        """Rebuild from `to_dict()`'s output."""


# The published release's name; importable for old code, not in `__all__`.
_PlacementSpec = PlacementSpec


@dataclass(frozen=True)
class ShardSpec(PlacementSpec):
    """torch `Shard(dim)`: contiguous chunks of `dim`, torch.chunk sizes (the last ones may be short or empty)."""

    dim: int

    def __post_init__(self) -> None:
        # Any int: a negative one is refused by the DTensorShardingMetadata that knows the tensor's dimensions.
        object.__setattr__(self, "dim", field_int(self.dim, "dim", "ShardSpec", minimum=-(1 << 63)))

    def to_dict(self) -> dict[str, Any]:
        return {"type": "Shard", "dim": self.dim}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardSpec:
        d = json_object(d, "data")
        return cls(_count(json_field(d, "dim", "ShardSpec"), "placement field 'dim'"))

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class ReplicateSpec(PlacementSpec):
    """torch `Replicate()`: every rank along this mesh dimension holds the same data."""

    def to_dict(self) -> dict[str, Any]:
        return {"type": "Replicate"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplicateSpec:
        return cls()

    def __str__(self) -> str:
        return "Replicate"


@dataclass(frozen=True)
class StridedShardSpec(PlacementSpec):
    """torch `_StridedShard(dim, split_factor)` (FSDP2 over TP).

    The dimension is first cut into `split_factor` chunks, each chunk into mesh-size pieces, and
    rank i keeps piece i of every chunk: its local data is several disjoint runs of the dimension.
    """

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "dim", field_int(self.dim, "dim", "StridedShardSpec", minimum=-(1 << 63)))
        object.__setattr__(self, "split_factor", field_int(self.split_factor, "split_factor", "StridedShardSpec", 1))

    def to_dict(self) -> dict[str, Any]:
        return {"type": "StridedShard", "dim": self.dim, "split_factor": self.split_factor}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StridedShardSpec:
        d = json_object(d, "data")
        split = _count(json_field(d, "split_factor", "StridedShardSpec"), "placement field 'split_factor'")
        if split < 1:
            raise ConfigError(f"placement field 'split_factor' is {split}; a split factor is at least 1")
        return cls(_count(json_field(d, "dim", "StridedShardSpec"), "placement field 'dim'"), split)

    def __str__(self) -> str:
        return f"StridedShard({self.dim}, {self.split_factor})"


_PLACEMENTS: dict[str, type[PlacementSpec]] = {
    "Shard": ShardSpec,
    "Replicate": ReplicateSpec,
    "StridedShard": StridedShardSpec,
}


# A tensor of more elements than this cannot exist (torch indexes elements with int64).
_MAX_NUMEL = (1 << 63) - 1
# torch's split factor counts the shards later mesh dimensions make, so it is at most a world size; the
# planner's work per strided dimension is min(split factor, dimension size).
_MAX_SPLIT_FACTOR = 1 << 20


def _count(value: Any, what: str) -> int:
    """A non-negative JSON int: a float, bool or string in a field the planner computes with is damage."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_NUMEL:
        raise ConfigError(f"{what} must be an int in [0, 2**63), got {value!r}")
    return value


def _counts(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, JSON_ARRAY):
        raise ConfigError(f"{what} must be a list of ints, got {type(value).__name__}")
    return tuple(_count(n, what) for n in value)


def placement_spec_from_dict(d: dict[str, Any]) -> PlacementSpec:
    kind = json_object(d, "placements[]").get("type", "")
    cls = _PLACEMENTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        known = f"placements[] (known: {sorted(_PLACEMENTS)})"
        raise unknown_to_this_engine(known, "the placement type", d.get("type"))
    return cls.from_dict(d)


@dataclass(frozen=True)
class DeviceMeshSpec:
    """A device mesh as data: `mesh_data` lists global ranks in row-major order of `mesh_shape`."""

    device_type: str
    mesh_shape: tuple[int, ...]
    mesh_data: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        shape, data = _check_mesh_fields(self.device_type, self.mesh_shape, self.mesh_data, self.mesh_dim_names)
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "mesh_data", data)
        if self.mesh_dim_names is not None:
            object.__setattr__(self, "mesh_dim_names", tuple(self.mesh_dim_names))

    @classmethod
    def from_mesh(
        cls, device_type: str, mesh: torch.Tensor, mesh_dim_names: tuple[str, ...] | None = None
    ) -> DeviceMeshSpec:
        """The spec of a DeviceMesh's rank tensor (`mesh.mesh`). Anything but an integer tensor is refused: a
        float tensor's ranks were truncated (0.5 read as rank 0), a list raised an AttributeError about
        `flatten`, and a str of names was split into letters (`"dp"` as `('d', 'p')`)."""
        if (
            not isinstance(mesh, torch.Tensor)
            or mesh.is_floating_point()
            or mesh.is_complex()
            or mesh.dtype == torch.bool
        ):
            kind = mesh.dtype if isinstance(mesh, torch.Tensor) else type(mesh).__name__
            raise ConfigTypeError(
                f"DeviceMeshSpec.from_mesh: mesh must be an integer tensor of ranks (a DeviceMesh's .mesh), got {kind}"
            )
        if isinstance(mesh_dim_names, str):
            raise ConfigTypeError(
                f"DeviceMeshSpec.from_mesh: mesh_dim_names must be a tuple of names, one per mesh dimension, got the "
                f"str {mesh_dim_names!r}; pass ({mesh_dim_names!r},)"
            )
        ranks = tuple(int(r) for r in mesh.flatten().tolist())
        names = None if mesh_dim_names is None else tuple(mesh_dim_names)
        return get_device_mesh_spec(device_type, tuple(mesh.shape), ranks, names)

    @property
    def mesh(self) -> torch.Tensor:
        return torch.tensor(self.mesh_data, dtype=torch.int64).reshape(self.mesh_shape)

    def get_coordinate(self, rank: int) -> tuple[int, ...] | None:
        """`rank`'s place in the mesh, None where it has none. The rank an integer scalar's plain int: a tensor
        (hashed by identity) found no place, and `True` found rank 1's."""
        if type(rank) is not int:
            rank = field_int(rank, "rank", "DeviceMeshSpec.get_coordinate", minimum=-(1 << 63))  # as an int: None
        return self.coordinates().get(rank)

    def coordinates(self) -> dict[int, tuple[int, ...]]:
        """rank -> mesh coordinate (a rank listed twice keeps its first place), built once per mesh.

        A load asks this for every tensor; scanning `mesh_data` each time cost O(world) per question.
        """
        derived = self._derived()
        coords: dict[int, tuple[int, ...]] | None = derived.get("coordinates")
        if coords is None:
            coords = {}
            for flat, rank in enumerate(self.mesh_data):
                if rank not in coords:
                    coords[rank] = self._unravel(flat)
            derived["coordinates"] = coords
        return coords

    def _unravel(self, flat: int) -> tuple[int, ...]:
        coord = []
        for n in reversed(self.mesh_shape):
            coord.append(flat % n)
            flat //= n
        return tuple(reversed(coord))

    def _derived(self) -> dict[str, Any]:
        """Per-mesh lookup tables, computed on first use; not part of equality, hashing or pickling."""
        derived: dict[str, Any] = self.__dict__.setdefault("_derived_tables", {})
        return derived

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Unpickled through the intern table: rank 0 groups every rank's gathered metadata by equality, and
        equal meshes that are one object compare in O(1) instead of rank by rank (2048 ranks x every tensor)."""
        return get_device_mesh_spec, (self.device_type, self.mesh_shape, self.mesh_data, self.mesh_dim_names)

    def __hash__(self) -> int:
        """The generated hash, computed once: a mesh of 2048 ranks is hashed for every tensor planned."""
        derived = self._derived()
        h: int | None = derived.get("hash")
        if h is None:
            h = hash((self.device_type, self.mesh_shape, self.mesh_data, self.mesh_dim_names))
            derived["hash"] = h
        return h

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_type": self.device_type,
            "mesh_shape": list(self.mesh_shape),
            "mesh_data": list(self.mesh_data),
            "mesh_dim_names": None if self.mesh_dim_names is None else list(self.mesh_dim_names),
        }

    def to_compact_dict(self) -> dict[str, Any]:
        """`to_dict` with `mesh_data` as arithmetic runs (metadata version 3.0): a 2048-rank mesh is one run."""
        return {**self.to_dict(), "mesh_data": encode_rank_list(self.mesh_data)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceMeshSpec:
        """Reads both `to_dict` (an explicit rank list) and `to_compact_dict` (runs), checking what the planner
        divides by and indexes with: a mesh dimension of size 0 or less has no chunks to plan."""
        d = json_object(d, "mesh_spec")
        device_type, shape_given, data = (
            json_field(d, k, "DeviceMeshSpec") for k in ("device_type", "mesh_shape", "mesh_data")
        )
        names = d.get("mesh_dim_names")
        if not isinstance(device_type, str):
            raise ConfigError(f"mesh field 'device_type' must be a string, got {device_type!r}")
        shape = _counts(shape_given, "mesh field 'mesh_shape'")
        if not shape or min(shape) < 1:
            raise ConfigError(f"mesh field 'mesh_shape' {list(shape)} must list one or more sizes of at least 1")
        if names is not None and (
            not isinstance(names, JSON_ARRAY) or len(names) != len(shape) or not all(isinstance(n, str) for n in names)
        ):
            raise ConfigError(f"mesh field 'mesh_dim_names' must be null or {len(shape)} strings, got {names!r}")
        return get_device_mesh_spec(
            device_type,
            shape,
            decode_rank_list(data, "mesh field 'mesh_data'"),
            None if names is None else tuple(names),
        )


def _check_mesh_fields(
    device_type: Any, mesh_shape: Any, mesh_data: Any, mesh_dim_names: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The mesh's shape and ranks as tuples of ints, or a ConfigError naming the first field of a mesh that no
    device mesh has (`DeviceMeshSpec("cpu", 2, [0, 1])` raised "'int' object is not iterable", and a mesh of
    negative sizes or ranks was built)."""
    record = "DeviceMeshSpec"
    if not isinstance(device_type, str) or not device_type:
        raise ConfigTypeError(
            f"{record}.device_type must be a device type such as 'cuda' or 'cpu', got {device_type!r}"
        )
    shape = field_ints(mesh_shape, "mesh_shape", record, minimum=1)
    if not shape:
        raise ConfigError(f"{record}.mesh_shape must list one size per mesh dimension, got {mesh_shape!r}")
    data = field_ints(mesh_data, "mesh_data", record)
    if math.prod(shape) != len(data):
        raise ConfigError(
            f"{record} mesh_shape {shape} holds {math.prod(shape)} ranks but mesh_data has {len(data)}; list every "
            f"rank of the mesh once, in row-major order"
        )
    if mesh_dim_names is not None and (
        not isinstance(mesh_dim_names, JSON_ARRAY)
        or len(mesh_dim_names) != len(shape)
        or not all(isinstance(n, str) for n in mesh_dim_names)
    ):
        raise ConfigTypeError(
            f"{record}.mesh_dim_names must be None or a tuple of {len(shape)} str (one per mesh dimension), got "
            f"{mesh_dim_names!r:.80}"
        )
    return shape, data


def get_device_mesh_spec(
    device_type: str,
    mesh_shape: tuple[int, ...],
    mesh_data: tuple[int, ...],
    mesh_dim_names: tuple[str, ...] | None = None,
) -> DeviceMeshSpec:
    """Interned: a model has many parameters on few meshes, so equal meshes share one object (however the
    arguments are spelled: positional or not, names given as None or left out, ranks as ints, numpy's integers
    or 0-d tensors). The key holds plain ints: a tensor hashes by identity, so each call with tensor ranks added
    an entry (its tensors and a spec of its own) to the unbounded table, for the life of the process."""
    if not _arrays(mesh_shape, mesh_data) or not (mesh_dim_names is None or isinstance(mesh_dim_names, JSON_ARRAY)):
        # `tuple()` takes any iterable: a dict's keys were a shape, and a str "xy" the names ('x', 'y')
        _check_mesh_fields(device_type, mesh_shape, mesh_data, mesh_dim_names)
    try:
        names = None if mesh_dim_names is None else tuple(mesh_dim_names)
        key = (device_type, _plain_ints(mesh_shape), _plain_ints(mesh_data), names)
        hash(key)
    except TypeError:  # no tuple, or one holding a list: said by field, not as "unhashable type"
        _check_mesh_fields(device_type, mesh_shape, mesh_data, mesh_dim_names)
        raise
    if not _ints_only(key[1]) or not _ints_only(key[2]):
        # Refused by field, never looked up: `True` and `1.0` equal 1, and found a mesh of ints interned before.
        return DeviceMeshSpec(*key)
    return _interned_mesh(*key)


def _arrays(*values: Any) -> bool:
    return all(isinstance(v, JSON_ARRAY) for v in values)


def _ints_only(values: tuple[Any, ...]) -> bool:
    return set(map(type, values)) <= {int}


def _plain_ints(values: Any) -> tuple[Any, ...]:
    """`values` as a tuple, its integer scalars as their ints (checked in C when they are ints already: a mesh
    lists every rank of a large job). What is no integer stays, for `DeviceMeshSpec` to refuse by field."""
    values = tuple(values)
    return values if _ints_only(values) else tuple(map(integer_as_int, values))


@functools.cache
def _interned_mesh(
    device_type: str, mesh_shape: tuple[int, ...], mesh_data: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None
) -> DeviceMeshSpec:
    return DeviceMeshSpec(device_type, mesh_shape, mesh_data, mesh_dim_names)


def _placement_to_spec(placement: Placement, where: str) -> PlacementSpec:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # _StridedShard is checked first: in some torch releases it subclasses Shard.
    if isinstance(placement, _StridedShard):
        return StridedShardSpec(int(placement.dim), int(placement.split_factor))
    if isinstance(placement, Shard):
        return ShardSpec(int(placement.dim))
    if isinstance(placement, Replicate):
        return ReplicateSpec()
    # A CheckpointError is a RuntimeError, the type the published release raised here.
    raise CheckpointError(
        f"Unsupported placement type {type(placement).__name__} ({placement}) for the DTensor {where}. "
        "Checkpoints support Shard, _StridedShard and Replicate placements; a Partial DTensor holds "
        "unreduced values, so redistribute it (e.g. dt.redistribute(placements=[Replicate()])) before saving."
    )


def refuse_partial_targets(item_key: str, template: Any) -> None:
    """Refuse a load into a template that holds a DTensor with a Partial placement, before anything is copied.

    A Partial DTensor's local tensor is an unreduced addend, not a slice of the global value, so no load can
    write what was saved into it. The refusal names the load (the metadata extraction that found it before
    spoke of saving) and the placements to use instead."""
    from torch.distributed.tensor import Partial

    for path, leaf in iter_leaves(template):
        if is_dtensor(leaf) and any(isinstance(p, Partial) for p in leaf.placements):
            dotted = dotted_key(path)
            where = f"{item_key}::{dotted}" if item_key and dotted else item_key or dotted
            raise TemplateMismatchError(
                f"The load target at {where} is a DTensor with placements {tuple(leaf.placements)}; a Partial "
                f"DTensor cannot be a load target (its local tensor holds unreduced values, not a slice of the "
                f"saved tensor). Nothing was loaded. Load into a DTensor with Replicate or Shard placements, e.g. "
                f"template = dt.redistribute(placements=[Replicate()]) before loading."
            )


@dataclass(frozen=True)
class DTensorShardingMetadata(ShardingMetadata, type_name="DTensorShardingMetadata"):
    """Everything needed to know which global slice any rank holds, without the live DTensor."""

    global_shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]
    mesh_spec: DeviceMeshSpec
    placements: tuple[PlacementSpec, ...]

    def __post_init__(self) -> None:
        self._check_types()
        if len(self.placements) != len(self.mesh_spec.mesh_shape):
            raise ConfigError(
                f"DTensorShardingMetadata has {len(self.placements)} placements for a "
                f"{len(self.mesh_spec.mesh_shape)}-D mesh; give one placement per mesh dimension"
            )
        for p in self.placements:
            dim = getattr(p, "dim", None)
            if dim is not None and not 0 <= dim < len(self.global_shape):
                raise ConfigError(f"Placement {p} shards dim {dim} of a {len(self.global_shape)}-D tensor")

    def _check_types(self) -> None:
        """Each field of the type it is (lists taken as the tuples they stand for), or a ConfigError naming it:
        `DTensorShardingMetadata(4, ...)` raised "object of type 'int' has no len()", a mesh given as a dict an
        AttributeError about `mesh_shape`."""
        record = "DTensorShardingMetadata"
        set_field = functools.partial(object.__setattr__, self)
        set_field("global_shape", field_ints(self.global_shape, "global_shape", record))
        set_field("stride", field_ints(self.stride, "stride", record))
        if len(self.stride) != len(self.global_shape):
            raise ConfigError(
                f"{record}.stride {self.stride} has {len(self.stride)} entries for global_shape {self.global_shape}"
            )
        if isinstance(self.dtype, torch.dtype):
            set_field("dtype", str(self.dtype))
        if not isinstance(self.dtype, str) or dtype_from_name(self.dtype) is None:
            raise ConfigError(f"{record}.dtype must name a torch dtype, e.g. 'torch.float32', got {self.dtype!r:.80}")
        if not isinstance(self.mesh_spec, DeviceMeshSpec):
            raise ConfigTypeError(
                f"{record}.mesh_spec must be a DeviceMeshSpec (DeviceMeshSpec.from_dict reads its dict), got "
                f"{type(self.mesh_spec).__name__}"
            )
        if not isinstance(self.placements, JSON_ARRAY) or not all(
            isinstance(p, PlacementSpec) for p in self.placements
        ):
            raise ConfigTypeError(
                f"{record}.placements must be a tuple of placement specs (ShardSpec(dim), ReplicateSpec(), "
                f"StridedShardSpec(dim, split_factor)), one per mesh dimension, got {self.placements!r:.80}"
            )
        set_field("placements", tuple(self.placements))

    @classmethod
    def from_dtensor(cls, dt: DTensor, where: str = "") -> DTensorShardingMetadata:
        """The metadata of a live DTensor; anything else is a `ConfigTypeError` (it was an AttributeError about
        `device_mesh`), naming `replicated()` for a plain tensor that every rank holds whole."""
        if not is_dtensor(dt):
            raise ConfigTypeError(
                f"DTensorShardingMetadata.from_dtensor needs a DTensor, got {type(dt).__name__}"
                f"{' at ' + where if where else ''}. For a plain tensor every rank holds whole, use "
                f"DTensorShardingMetadata.replicated(tensor, world_size)."
            )
        mesh = dt.device_mesh
        mesh_spec = DeviceMeshSpec.from_mesh(mesh.device_type, mesh.mesh, mesh.mesh_dim_names)
        placements = tuple(_placement_to_spec(p, where or "being checkpointed") for p in dt.placements)
        return cls(tuple(dt.shape), str(dt.dtype), tuple(dt.stride()), mesh_spec, placements)

    @classmethod
    def replicated(cls, tensor: torch.Tensor, world_size: int) -> DTensorShardingMetadata:
        """Metadata of a plain tensor that every rank of a `world_size` job holds whole."""
        if not isinstance(tensor, torch.Tensor):
            raise ConfigTypeError(
                f"DTensorShardingMetadata.replicated needs a torch.Tensor, got {type(tensor).__name__} {tensor!r:.80}"
            )
        world_size = field_int(world_size, "world_size", "DTensorShardingMetadata.replicated", minimum=1)
        if world_size > MAX_WORLD_SIZE:  # its mesh lists every rank: 10**9 of them exhausted memory
            raise ConfigError(
                f"DTensorShardingMetadata.replicated: world_size {world_size} exceeds {MAX_WORLD_SIZE}, the most "
                f"ranks a checkpoint may record"
            )
        mesh_spec = get_device_mesh_spec(tensor.device.type, (world_size,), tuple(range(world_size)), None)
        return cls(tuple(tensor.shape), str(tensor.dtype), tuple(tensor.stride()), mesh_spec, (ReplicateSpec(),))

    @property
    def torch_dtype(self) -> torch.dtype:
        value = dtype_from_name(self.dtype)
        if value is None:
            raise ConfigError(f"Unknown dtype {self.dtype!r} in sharding metadata")
        return value

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "stride": list(self.stride),
            "mesh_spec": self.mesh_spec.to_dict(),
            "placements": [p.to_dict() for p in self.placements],
        }

    def to_compact_dict(self) -> dict[str, Any]:
        return {**self.to_dict(), "mesh_spec": self.mesh_spec.to_compact_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DTensorShardingMetadata:
        """Read from untrusted JSON: every number the planner computes with is checked here (a bad one is a
        ConfigError naming the field), so planning a load is arithmetic on sane values, in bounded time."""
        d = json_object(d, "data")
        shape_given, stride_given, dtype, mesh_given, placements_given = (
            json_field(d, k, "DTensorShardingMetadata")
            for k in ("global_shape", "stride", "dtype", "mesh_spec", "placements")
        )
        shape = _counts(shape_given, "field 'global_shape'")
        if math.prod(shape) > _MAX_NUMEL:
            raise ConfigError(f"field 'global_shape' {list(shape)} holds more than 2**63 elements")
        stride = _counts(stride_given, "field 'stride'")
        if len(stride) != len(shape):
            raise ConfigError(
                f"field 'stride' {list(stride)} has {len(stride)} entries for field 'global_shape' {list(shape)}, "
                f"a {len(shape)}-D tensor"
            )
        if not isinstance(dtype, str) or dtype_from_name(dtype) is None:  # a newer torch's dtype is no damage
            name = dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype
            raise unknown_to_this_engine(f"field 'dtype' ({dtype!r})", "the torch dtype", name)
        mesh = DeviceMeshSpec.from_dict(mesh_given)
        if not isinstance(placements_given, JSON_ARRAY):
            kind = type(placements_given).__name__
            raise ConfigError(f"field 'placements' must be a list of placements, got {kind}")
        placements = tuple(placement_spec_from_dict(p) for p in placements_given)
        for p in placements:
            if isinstance(p, StridedShardSpec) and p.split_factor > _MAX_SPLIT_FACTOR:
                raise ConfigError(f"placement field 'split_factor' {p.split_factor} exceeds {_MAX_SPLIT_FACTOR}")
        return cls(shape, dtype, stride, mesh, placements)

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return self.mesh_spec.mesh_data
