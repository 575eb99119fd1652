"""Sharding metadata for a whole checkpoint: what each rank saved, and where.

Rank 0 writes this as JSON next to the item files so that a later job with a
different world size or mesh can work out which source rank holds which slice.
It is plain JSON on purpose: reading a checkpoint never unpickles anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
    TorchSerialization,
    default_layout_info,
)
from torch_checkpointing.config import integer_as_int
from torch_checkpointing.errors import (
    ConfigError,
    ConfigTypeError,
    CorruptCheckpointError,
    NewerCheckpointError,
    UnsafeCheckpointError,
    unknown_to_this_engine,
)
from torch_checkpointing.manifest import MAX_WORLD_SIZE
from torch_checkpointing.read_context import (
    MAX_METADATA_BYTES,
    CheckpointReadContext,
    checked_relative_path,
    parse_json_bounded,
)
from torch_checkpointing.storage.base_storage import Storage, StorageConfig
from torch_checkpointing.traversal import dotted_key
from torch_checkpointing.types import (
    CheckpointPath,
    NestedPath,
    check_path_map,
    conversion_hint,
    holds_infinity,
    json_component,
    tuples_from_json,
)

METADATA_FILE_NAME = "metadata.json"
METADATA_VERSION = "3.0"
# 3.0 whose nested paths hold a component other than a str or an int (a bool, float or None dict key, a tuple key):
# an engine reading up to 3.0 refused those as a malformed file, and calls this version a newer engine's instead.
METADATA_VERSION_ANY_KEY = "3.1"
# How deep metadata.json may nest for a load to read it (every value counts, a number as much as an object), and
# so how deep a ShardingMetadata's data may (its object is the 8th level: the file, metadata, the item,
# nested_path_to_metadata, the path's groups, a group, sharding_metadata, data).
METADATA_MAX_DEPTH = 64
STORED_DATA_DEPTH = METADATA_MAX_DEPTH - 7
# 2.0 lists every rank of every mesh and group explicitly; 3.0 (same structure) writes such lists as
# arithmetic runs, so a tensor's entry no longer grows with the world size. Both are read.
READABLE_METADATA_VERSIONS = ("2.0", "3.0", METADATA_VERSION_ANY_KEY)
_MAX_WORLD_SIZE = MAX_WORLD_SIZE  # one bound for the manifest and the sharding metadata
# What a `from_dict` takes for a JSON array: the list a file gives, or the tuple of the in-process form API_SURFACE
# shows (`"ranks": (0,)`, `"mesh_shape": (1,)`); a tuple was refused as "not a list", so documented dicts never read.
JSON_ARRAY = (list, tuple)


def json_object(value: Any, what: str) -> dict[str, Any]:
    """`value` when it is a JSON object (a dict), else a ConfigError naming the field: metadata.json is untrusted,
    and an array or a string where an object belongs escaped as AttributeError ("'list' object has no attribute
    'items'")."""
    if not isinstance(value, dict):
        raise ConfigError(f"field {what!r} must be a JSON object, got {type(value).__name__} {str(value)[:80]}")
    return value


def json_field(d: dict[str, Any], name: str, record: str) -> Any:
    """`d[name]`, or a ConfigError naming the field and the record that lacks it: a `from_dict` given a dict
    without one raised a bare `KeyError: 'global_shape'`, which names neither the record nor the fix."""
    try:
        return d[name]
    except KeyError:
        given = ", ".join(repr(k) for k in list(d)[:8]) or "no field"
        raise ConfigError(
            f"The {record} record has no field {name!r} (it holds {given}); pass the dict {record}.to_dict() writes."
        ) from None


def field_int(value: Any, field: str, record: str, minimum: int = 0) -> int:
    """`value` as the plain int it stands for (see `integer_as_int`) when it is at least `minimum`, else a
    ConfigError naming `record.field`: the records' constructors took anything, and failed later, far from the
    call, in words about `len()`. The caller stores what this returns: a numpy integer kept in a record failed
    the record's JSON dump at save."""
    value = integer_as_int(value)
    if type(value) is not int:  # a bool, float or str; an int subclass is already its int
        raise ConfigTypeError(f"{record}.{field} must be an int, got {type(value).__name__} {value!r:.80}")
    if value < minimum:
        raise ConfigError(f"{record}.{field} must be at least {minimum}, got {value}")
    return value


def field_ints(value: Any, field: str, record: str, minimum: int = 0) -> tuple[int, ...]:
    """`value` as a tuple of plain ints of at least `minimum` (a list is taken as the tuple the field is: a record
    built from lists compared unequal to the tuple-built one, and did not hash; numpy's integers as the ints they
    stand for). A tuple of ints is returned as the object it is: parsed rank lists are shared objects, which
    `_check_groups` tells apart by identity. The checks run in C (`map`, `min`): a group lists every rank of a
    large job, for every tensor."""
    if not isinstance(value, JSON_ARRAY):
        raise ConfigTypeError(f"{record}.{field} must be a tuple of ints, got {type(value).__name__} {value!r:.80}")
    ints = value if type(value) is tuple else tuple(value)
    if not set(map(type, ints)) <= {int}:
        ints = tuple(map(integer_as_int, ints))
        if not set(map(type, ints)) <= {int}:  # a bool, float or str
            wrong = next(v for v in ints if type(v) is not int)
            raise ConfigTypeError(f"{record}.{field} must hold ints only, got {type(wrong).__name__} {wrong!r:.80}")
    if ints and min(ints) < minimum:
        raise ConfigError(f"{record}.{field} must hold ints of at least {minimum}, got {min(ints)}")
    return ints


def within(exc: ValueError, where: str) -> ConfigError:
    """`exc`, a refusal met inside a record, told with `where` in front: a `ConfigTypeError` stays one (the
    wrappers re-raised every such refusal as a plain ValueError)."""
    kind = ConfigTypeError if isinstance(exc, TypeError) else ConfigError
    return kind(f"{where}{exc}")


# Ranks a parse may expand from runs (distinct lists only: equal ones decode once): bounds what a small
# hostile file can make this process allocate, far above any real job's few distinct meshes.
_DECODE_BUDGET = 1 << 24

__all__ = [
    "JSON_ARRAY",
    "METADATA_FILE_NAME",
    "METADATA_MAX_DEPTH",
    "STORED_DATA_DEPTH",
    "CheckpointMetadata",
    "DistributedItemMetadata",
    "DistributedMetadata",
    "GlobalObjectMetadata",
    "ItemMetadata",
    "ShardingMetadata",
    "StoredShardingMetadata",
    "build_distributed_metadata",
    "decode_rank_list",
    "encode_rank_list",
    "field_int",
    "field_ints",
    "json_field",
    "json_object",
    "layout_from_untrusted_dict",
    "load_distributed_metadata",
    "nested_path_from_json",
    "nested_path_to_json",
    "parse_distributed_metadata",
    "read_distributed_metadata",
    "sharding_type",
    "unknown_types_as_stored",
    "within",
]


class ShardingMetadata(ABC):
    """How one object is spread over ranks. Subclasses register under a type name so JSON can name them."""

    _registry: ClassVar[dict[str, type[ShardingMetadata]]] = {}
    _type_name: ClassVar[str]

    def __init_subclass__(cls, /, type_name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = type_name or cls.__name__
        cls._type_name = name
        ShardingMetadata._registry[name] = cls

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (str keys, lists, numbers, strings, None)."""

    @classmethod
    @abstractmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardingMetadata:
        """The metadata `to_dict` returned, rebuilt (it must compare equal to the original)."""

    @property
    @abstractmethod
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        """Ranks guaranteed to hold identical metadata (None when the notion does not apply)."""

    def to_compact_dict(self) -> dict[str, Any]:
        """What metadata version 3.0 stores; `from_dict` must read it. Default: `to_dict()`."""
        return self.to_dict()

    def _pack(self, compact: bool = False) -> dict[str, Any]:
        return {"type": self._type_name, "data": self.to_compact_dict() if compact else self.to_dict()}

    @staticmethod
    def _unpack(packed: dict[str, Any]) -> ShardingMetadata:
        if not isinstance(packed, dict) or "type" not in packed:
            raise ConfigError(
                f"Invalid ShardingMetadata format: missing 'type' in {packed!r}; "
                "expected {'type': <registered name>, 'data': {...}}"
            )
        kind = packed["type"]
        if not isinstance(kind, str):
            raise ConfigError(f"field 'type' of packed ShardingMetadata must be a registered type name, got {kind!r}")
        if kind not in ShardingMetadata._registry:
            _register_builtin_types()
        cls = ShardingMetadata._registry.get(kind)
        if cls is None and _as_stored.get():
            return StoredShardingMetadata(kind, packed.get("data", {}))
        if cls is None:
            available = ", ".join(sorted(ShardingMetadata._registry))
            raise ConfigError(
                f"Unknown ShardingMetadata type '{kind}'. Available types: {available}. "
                "Import the module defining it before loading the checkpoint."
            )
        return cls.from_dict(packed.get("data", {}))


class StoredShardingMetadata(ShardingMetadata, type_name="<stored>"):
    """Sharding metadata of a type that no class imported in this process registers, kept as it is stored.

    Only tools read metadata so (`unknown_types_as_stored`): `verify`, `inspect` and `diff` of a checkpoint saved
    with a user's own resharder, whose metadata class the CLI never imports (nothing a checkpoint names is
    imported). Before, such a healthy checkpoint read as "malformed" to every tool. No file can name this class.
    """

    def __init__(self, stored_type: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"the data of sharding metadata type {stored_type!r} is not an object: {data!r}")
        self.stored_type = stored_type
        self.data = data

    def to_dict(self) -> dict[str, Any]:
        return self.data

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardingMetadata:
        raise ConfigError("stored sharding metadata is never resolved from a file")

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None

    def _pack(self, compact: bool = False) -> dict[str, Any]:
        return {"type": self.stored_type, "data": self.data}


del ShardingMetadata._registry["<stored>"]
_as_stored: contextvars.ContextVar[bool] = contextvars.ContextVar("_sharding_types_as_stored", default=False)


@contextlib.contextmanager
def unknown_types_as_stored() -> Iterator[None]:
    """Within it, metadata parsed from a checkpoint keeps a sharding type no imported class registers as a
    `StoredShardingMetadata` instead of refusing it (loads never do: their resharder needs the class)."""
    token = _as_stored.set(True)
    try:
        yield
    finally:
        _as_stored.reset(token)


def sharding_type(meta: ShardingMetadata) -> str:
    """The type name a checkpoint stores for `meta`."""
    return meta.stored_type if isinstance(meta, StoredShardingMetadata) else meta._type_name


def encode_rank_list(ranks: Sequence[int]) -> list[int] | dict[str, list[list[int]]]:
    """`{"runs": [[start, count, step], ...]}` when that is shorter than the explicit list, else the list.

    Meshes and rank groups are nearly always `range(world)` or a few strided runs of it (TP-major meshes).
    """
    if len(ranks) > 3:
        start, step = ranks[0], ranks[1] - ranks[0]
        if step and tuple(ranks) == tuple(range(start, start + len(ranks) * step, step)):  # compared in C
            return {"runs": [[int(start), len(ranks), int(step)]]}
    runs: list[list[int]] = []
    i = 0
    while i < len(ranks):
        start = ranks[i]
        step = ranks[i + 1] - start if i + 1 < len(ranks) else 1
        count = 1
        while i + count < len(ranks) and ranks[i + count] == start + count * step:
            count += 1
        runs.append([start, count, step if count > 1 else 1])
        i += count
    if 3 * len(runs) >= len(ranks):
        return [int(r) for r in ranks]
    return {"runs": runs}


def decode_rank_list(value: Any, what: str) -> tuple[int, ...]:
    """The rank tuple `encode_rank_list` (or an explicit list) stands for; equal encodings share one tuple."""
    if isinstance(value, dict):
        runs = value.get("runs")
        if set(value) != {"runs"} or not isinstance(runs, JSON_ARRAY):
            raise ConfigError(f"{what} must be a list of ranks or {{'runs': [[start, count, step], ...]}}")
        key = tuple(_run(r, what) for r in runs)
        return _decoded_runs(key, what)
    if not isinstance(value, JSON_ARRAY):
        raise ConfigError(f"{what} must be a list of ranks, got {type(value).__name__}")
    return tuple(_rank_number(r, what) for r in value)


def _run(run: Any, what: str) -> tuple[int, int, int]:
    if not isinstance(run, JSON_ARRAY) or len(run) != 3:
        raise ConfigError(f"{what}: a run must be [start, count, step], got {run!r}")
    start, count, step = (_rank_number(x, what, signed=True) for x in run)
    last = start + (count - 1) * step
    if not 1 <= count <= _MAX_WORLD_SIZE or not (0 <= start < _MAX_WORLD_SIZE and 0 <= last < _MAX_WORLD_SIZE):
        raise ConfigError(f"{what}: run {run!r} leaves ranks 0 to {_MAX_WORLD_SIZE - 1}")
    return start, count, step


def _rank_number(x: Any, what: str, signed: bool = False) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or (x < 0 and not signed):
        raise ConfigError(f"{what} holds {x!r}, not a rank number")
    return x


T = TypeVar("T")

_decode_cache: dict[tuple[tuple[int, int, int], ...], tuple[int, ...]] = {}
_budget: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("_rank_decode_budget", default=None)


def _decoded_runs(key: tuple[tuple[int, int, int], ...], what: str) -> tuple[int, ...]:
    cached = _decode_cache.get(key)
    if cached is not None:
        return cached
    total = sum(count for _, count, _ in key)
    budget = _budget.get()
    if total > _MAX_WORLD_SIZE or (budget is not None and total > budget[0]):
        raise ConfigError(f"{what}: its runs expand to more ranks than a metadata file may describe")
    if budget is not None:
        budget[0] -= total
    out = tuple(r for start, count, step in key for r in range(start, start + count * step, step))
    held = sum(len(t) for t in _decode_cache.values())
    if held + len(out) > _MAX_WORLD_SIZE * 4:
        _decode_cache.clear()
    _decode_cache[key] = out
    return out


@contextlib.contextmanager
def _decode_budget() -> Iterator[None]:
    token = _budget.set([_DECODE_BUDGET])
    try:
        yield
    finally:
        _budget.reset(token)


ItemMetadata = dict[NestedPath, ShardingMetadata]


def nested_path_to_json(path: NestedPath) -> str:
    """Compact JSON list, exact in the round trip: its components are those `CheckpointPath.serialize` writes
    (str, int, float, bool, None and tuples of them, a tuple as a JSON list)."""
    recordable_path(path)
    return json.dumps(list(path), separators=(",", ":"))


def recordable_path(path: NestedPath, item: str | None = None) -> NestedPath:
    """`path` when metadata.json can record it, else the ConfigError naming the component (and `item`, the key
    of the item being saved, where known) and the conversion that fixes a numpy scalar key: a record that took
    a path (any dict key) its `to_dict` then refused failed the save late, at the metadata write."""
    for comp in path:
        if not json_component(comp):
            where = f"Item {item!r}: nested path" if item is not None else "Nested path"
            raise ConfigError(
                f"{where} {path!r:.120} has component {comp!r:.80} of type {type(comp).__name__}; only str, int, "
                "float (not NaN: read back, it equals no key), bool and None dict keys, int indices and tuples of them "
                f"can be recorded in sharding metadata.{conversion_hint(comp)}"
            )
    return path


def _refuse_infinite_key(key: str, path: NestedPath) -> None:
    """A path under an infinite float key is refused where metadata.json is written: JSON has no infinity, and
    the bare `Infinity` Python writes makes jq, `JSON.parse` and every strict parser refuse the whole file. The
    record itself takes it (a file an older engine wrote with `Infinity` still reads)."""
    for depth, comp in enumerate(path):
        if holds_infinity(comp):
            raise ConfigError(
                f"Cannot save item {key!r}: the dict at {CheckpointPath(key, path[:depth])} has the key {comp!r:.80}, "
                f"which is or holds an infinite float; metadata.json is strict JSON, which has no infinity. Rename "
                f"the key (e.g. to the str 'inf'). Nothing was saved."
            )


def nested_path_from_json(s: str) -> NestedPath:
    """The nested path `s` (JSON) names; a ConfigError for text that is no JSON list of components, or one nested
    past what the parser or the component checks recurse through (a bare RecursionError before)."""
    try:
        parts = json.loads(s)
        if isinstance(parts, list) and all(map(json_component, parts)):
            return tuple(map(tuples_from_json, parts))
    except (ValueError, RecursionError):  # JSONDecodeError: a key that is no JSON at all
        pass
    raise ConfigError(
        f"Nested path {s!r:.200} is not a JSON list of str, int, float (not NaN), bool, null components (or lists "
        "of them)"
    )


# Rank tuples already checked, by identity (each kept, so its id is not reused): a parsed file's rank lists are
# shared objects, and a group of a large job lists thousands of ranks, for every tensor.
_CHECKED_RANKS: dict[int, tuple[int, ...]] = {}
_CHECKED_RANKS_MAX = 1024


def _checked_ranks(ranks: Any) -> tuple[int, ...]:
    seen = _CHECKED_RANKS.get(id(ranks))
    if seen is not None and seen is ranks:
        return seen
    checked = field_ints(ranks, "ranks", "GlobalObjectMetadata")
    if len(_CHECKED_RANKS) >= _CHECKED_RANKS_MAX:
        _CHECKED_RANKS.clear()
    _CHECKED_RANKS[id(checked)] = checked
    return checked


@dataclass(frozen=True)
class GlobalObjectMetadata:
    """One sharding layout and the ranks that reported exactly it."""

    sharding_metadata: ShardingMetadata
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.sharding_metadata, ShardingMetadata):
            raise ConfigTypeError(
                f"GlobalObjectMetadata.sharding_metadata must be a ShardingMetadata (e.g. a DTensorShardingMetadata), "
                f"got {type(self.sharding_metadata).__name__}"
            )
        object.__setattr__(self, "ranks", _checked_ranks(self.ranks))

    def to_dict(self, compact: bool = False) -> dict[str, Any]:
        """Version 2.0's explicit form; `compact=True` gives version 3.0's (rank lists as runs)."""
        if not compact:
            return {"sharding_metadata": self.sharding_metadata._pack(), "ranks": list(self.ranks)}
        return {"sharding_metadata": self.sharding_metadata._pack(True), "ranks": encode_rank_list(self.ranks)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GlobalObjectMetadata:
        d = json_object(d, "data")
        packed, ranks = (json_field(d, k, "GlobalObjectMetadata") for k in ("sharding_metadata", "ranks"))
        try:
            metadata = ShardingMetadata._unpack(packed)
        except ValueError as exc:
            raise within(exc, "field 'sharding_metadata': ") from None
        return cls(metadata, decode_rank_list(ranks, "ranks"))


@dataclass(frozen=True)
class DistributedItemMetadata:
    """All ranks' metadata for one item, plus each rank's file layout (None = default layout)."""

    nested_path_to_metadata: dict[NestedPath, list[GlobalObjectMetadata]]
    rank_to_layout_info: dict[int, LayoutInfo | None]

    def __post_init__(self) -> None:
        record = "DistributedItemMetadata"
        check_path_map(self.nested_path_to_metadata, f"{record}.nested_path_to_metadata", GlobalObjectMetadata)
        for path in self.nested_path_to_metadata:
            recordable_path(path)
        if not isinstance(self.rank_to_layout_info, dict):
            raise ConfigTypeError(
                f"{record}.rank_to_layout_info must be a dict of rank -> LayoutInfo or None, got "
                f"{type(self.rank_to_layout_info).__name__}"
            )
        ranks = {field_int(r, f"rank_to_layout_info key {r!r}", record): r for r in self.rank_to_layout_info}
        if len(ranks) != len(self.rank_to_layout_info):  # `0` and an `__index__` object standing for 0
            raise ConfigError(
                f"{record}.rank_to_layout_info names a rank twice: {list(self.rank_to_layout_info)!r:.120}"
            )
        for rank, layout in self.rank_to_layout_info.items():
            if layout is not None and not isinstance(layout, LayoutInfo):
                raise ConfigTypeError(
                    f"{record}.rank_to_layout_info[{rank}] must be a LayoutInfo or None (the default layout), got "
                    f"{type(layout).__name__} {layout!r:.80}"
                )
        if any(type(r) is not int for r in self.rank_to_layout_info):  # numpy's ranks kept failed the save's sort
            layouts = {rank: self.rank_to_layout_info[given] for rank, given in ranks.items()}
            object.__setattr__(self, "rank_to_layout_info", layouts)

    def get_file_path(self, rank: int, checkpoint_path: Path, item_key: str) -> Path:
        """Where `rank` wrote the item under `checkpoint_path`: its layout's file, or the default layout's."""
        call = "DistributedItemMetadata.get_file_path"
        if not isinstance(checkpoint_path, (str, os.PathLike)):
            raise ConfigTypeError(
                f"{call}: checkpoint_path must be a path (str or Path), got {type(checkpoint_path).__name__} "
                f"{checkpoint_path!r:.80}"
            )
        return Path(checkpoint_path) / self._layout(rank, item_key, call).file_path

    def get_layout(self, rank: int, item_key: str) -> LayoutInfo:
        """`rank`'s layout of the item, `default_layout_info(item_key, rank)` where it recorded none."""
        return self._layout(rank, item_key, "DistributedItemMetadata.get_layout")

    def _layout(self, rank: int, item_key: str, call: str) -> LayoutInfo:
        """`get_layout`, a rank or key of the wrong type refused naming it and `call`: a str rank found no layout
        and named the file "k_0.pt" for "0", a bool one "k_True.pt", a Path key a bare TypeError."""
        rank = field_int(rank, "rank", call)
        if not isinstance(item_key, str):
            raise ConfigTypeError(f"{call}: item_key must be a str, got {type(item_key).__name__} {item_key!r:.80}")
        return self.rank_to_layout_info.get(rank) or default_layout_info(item_key, rank)

    def get_metadata_for_path_and_rank(self, nested_path: NestedPath, rank: int) -> ShardingMetadata | None:
        """The sharding metadata `rank` recorded for `nested_path`, or None when it recorded none."""
        for group in self.nested_path_to_metadata.get(tuple(nested_path), []):
            if rank in group.ranks:
                return group.sharding_metadata
        return None

    def get_all_ranks(self) -> set[int]:
        """Every rank that recorded a layout or metadata for the item."""
        ranks = set(self.rank_to_layout_info)
        for groups in self.nested_path_to_metadata.values():
            for group in groups:
                ranks.update(group.ranks)
        return ranks

    def get_nested_paths(self) -> set[NestedPath]:
        """The nested paths some rank recorded metadata for."""
        return set(self.nested_path_to_metadata)

    def to_dict(self, compact: bool = False) -> dict[str, Any]:
        """The item's part of `metadata.json`: nested paths as compact JSON lists, rank keys as str, layouts as
        `LayoutInfo.to_dict()` or None; `compact=True` gives version 3.0's form (rank lists as runs)."""
        return {
            "nested_path_to_metadata": {
                nested_path_to_json(p): [g.to_dict(compact) for g in groups]
                for p, groups in self.nested_path_to_metadata.items()
            },
            # JSON object keys are strings; from_dict turns them back into ints.
            "rank_to_layout_info": {
                str(r): (None if lay is None else lay.to_dict()) for r, lay in sorted(self.rank_to_layout_info.items())
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DistributedItemMetadata:
        """The item's metadata from either form `to_dict` writes."""
        paths: dict[NestedPath, list[GlobalObjectMetadata]] = {}
        spelled: dict[Any, str] = {}
        d = json_object(d, "item metadata")
        by_path = json_field(d, "nested_path_to_metadata", "DistributedItemMetadata")
        for p, groups in json_object(by_path, "nested_path_to_metadata").items():
            if not isinstance(groups, JSON_ARRAY) or not groups or not all(isinstance(g, dict) for g in groups):
                # an empty list read as "not in the checkpoint": the template entry was silently left as it was
                raise ConfigError(
                    f"nested_path_to_metadata {p}: expected a non-empty list of sharding groups (objects), "
                    f"got {type(groups).__name__} {str(groups)[:80]}"
                )
            try:
                path = _once(nested_path_from_json(p), p, spelled, "nested_path_to_metadata")
                paths[path] = [GlobalObjectMetadata.from_dict(g) for g in groups]
            except ValueError as exc:  # a bad value: say where it is
                raise within(exc, f"path {p}: ") from None
        layouts: dict[int, LayoutInfo | None] = {}
        ranks: dict[Any, str] = {}
        layout_of = json_field(d, "rank_to_layout_info", "DistributedItemMetadata")
        for r, lay in json_object(layout_of, "rank_to_layout_info").items():
            rank = _once(_rank(r), r, ranks, "rank_to_layout_info")
            layouts[rank] = None if lay is None else layout_from_untrusted_dict(lay, f"rank_to_layout_info.{r}")
        return cls(paths, layouts)


@dataclass(frozen=True)
class DistributedMetadata:
    """The `metadata.json` of one checkpoint: every resharded item, for every rank of the saving job."""

    metadata: dict[str, DistributedItemMetadata]
    world_size: int
    version: str = METADATA_VERSION

    def __post_init__(self) -> None:
        self._check_types()
        if self.version == METADATA_VERSION and not self._paths_of_str_and_int():
            object.__setattr__(self, "version", METADATA_VERSION_ANY_KEY)
        expected = set(range(self.world_size))
        owners: dict[str, tuple[str, int]] = {}
        for key, item in self.metadata.items():
            ranks = set(item.rank_to_layout_info)
            if ranks != expected:
                # RuntimeError, not a CheckpointError: the type recorded in API_SURFACE §5.3, which callers catch
                raise RuntimeError(
                    f"Item '{key}' rank_to_layout_info must contain all ranks 0 to {self.world_size - 1}. "
                    f"Missing ranks: {sorted(expected - ranks)}, Extra ranks: {sorted(ranks - expected)}"
                )
            for rank, layout in sorted(item.rank_to_layout_info.items()):
                if layout is None:
                    continue
                prev = owners.get(layout.file_path)
                if prev is not None:
                    # RuntimeError, not a CheckpointError: the type recorded in API_SURFACE §5.3, which callers catch
                    raise RuntimeError(
                        f"Item '{prev[0]}' rank {prev[1]} & item '{key}' rank {rank} both write to the same "
                        f"file path {layout.file_path}; put {{rank}} in the layout's file_path"
                    )
                owners[layout.file_path] = (key, rank)

    def _paths_of_str_and_int(self) -> bool:
        """Whether every nested path holds str and int components only (what an engine reading up to 3.0 reads).
        An IntEnum member or a str subclass is written as the same plain JSON int or string: only a bool, of the
        ints, is not (an exact-type test called their files 3.1, which that engine refused as a newer one's)."""
        return all(
            isinstance(c, (str, int)) and not isinstance(c, bool)
            for item in self.metadata.values()
            for p in item.nested_path_to_metadata
            for c in p
        )

    def _check_types(self) -> None:
        """Each field of the type it is, `world_size` within what a save may have, before anything is computed
        from them (a world_size of 10**12 built a set of that many ranks)."""
        if not isinstance(self.metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, DistributedItemMetadata) for k, v in self.metadata.items()
        ):
            raise ConfigTypeError(
                f"DistributedMetadata.metadata must be a dict of item key (str) -> DistributedItemMetadata, got "
                f"{self.metadata!r:.120}"
            )
        object.__setattr__(self, "world_size", field_int(self.world_size, "world_size", "DistributedMetadata", 1))
        if self.world_size > _MAX_WORLD_SIZE:
            raise ConfigError(f"DistributedMetadata.world_size {self.world_size} exceeds {_MAX_WORLD_SIZE}")
        if not isinstance(self.version, str):
            raise ConfigTypeError(
                f"DistributedMetadata.version must be a str such as {METADATA_VERSION!r}, got {self.version!r:.80}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON; its form follows `version` (a 2.0 checkpoint rewritten stays 2.0)."""
        compact = self.version != "2.0"
        for key, item in self.metadata.items():
            for path in item.nested_path_to_metadata:
                _refuse_infinite_key(key, path)
        return {
            "metadata": {k: v.to_dict(compact) for k, v in self.metadata.items()},
            "world_size": self.world_size,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DistributedMetadata:
        version = json_field(json_object(d, "metadata.json"), "version", "DistributedMetadata")
        if _newer_version(version):
            raise NewerCheckpointError(
                f"field 'version' is {version!r}; this engine reads sharding metadata versions "
                f"{', '.join(READABLE_METADATA_VERSIONS)}. A newer engine wrote this checkpoint: load it with that "
                f"engine or a newer one (it is not damaged; do not delete it)."
            )
        if version not in READABLE_METADATA_VERSIONS:
            readable = ", ".join(repr(v) for v in READABLE_METADATA_VERSIONS)
            why = (
                "Version '1.0' is the published release's format, kept in a pickled metadata.pkl, which this engine "
                "never unpickles (docs/api_differences.md): save the checkpoint again with this engine."
                if version == "1.0"
                else "A newer engine wrote this checkpoint: load it with that engine or a newer one."
            )
            raise ConfigError(
                f"Unsupported sharding metadata version {version!r} (field 'version'); this engine reads versions "
                f"{readable}. {why}"
            )
        world_size = json_field(d, "world_size", "DistributedMetadata")
        if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= _MAX_WORLD_SIZE:
            raise ConfigError(f"field 'world_size' must be an int in [1, {_MAX_WORLD_SIZE}], got {world_size!r}")
        with _decode_budget():
            records = json_object(json_field(d, "metadata", "DistributedMetadata"), "metadata")
            items = {k: _item_from_dict(k, v) for k, v in records.items()}
        checked: dict[tuple[int, int], None] = {}
        for key, item in items.items():
            for path, groups in item.nested_path_to_metadata.items():
                _check_groups(f"item {key!r} path {nested_path_to_json(path)}", groups, world_size, checked)
        return cls(items, world_size, version)

    def to_json(self) -> str:
        """The bytes of metadata.json, strict JSON. Not indented: Python encodes indented JSON without its C
        encoder."""
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> DistributedMetadata:
        """`to_json()`'s text read back; text that is no JSON is a `ValueError` in these words, not json's own
        JSONDecodeError, and an argument that is no text a `ConfigTypeError`."""
        if not isinstance(text, (str, bytes)):
            raise ConfigTypeError(
                f"DistributedMetadata.from_json takes the str or bytes to_json() writes, got {type(text).__name__}"
            )
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # nested past the parser's depth
            raise ConfigError(f"DistributedMetadata.from_json: the text is no JSON ({exc})") from None
        return cls.from_dict(value)


def _item_from_dict(key: str, d: dict[str, Any]) -> DistributedItemMetadata:
    try:
        return DistributedItemMetadata.from_dict(d)
    except ValueError as exc:
        raise within(exc, f"item {key!r} ") from None
    except CorruptCheckpointError as exc:  # a newer engine's record inside it: its kind kept, the item named
        raise type(exc)(f"item {key!r}: {exc}") from None


def _check_groups(
    where: str, groups: list[GlobalObjectMetadata], world_size: int, checked: dict[tuple[int, int], None]
) -> None:
    """One path's groups name only ranks the save had, each rank in one group; a DTensor's mesh, too, names
    only ranks the save had, each once, and holds every rank that reported it.

    A rank outside the world has no file (a planner would read one that is not there); a rank in two groups
    has two layouts; a rank outside its mesh, or a mesh place no rank fills, holds no block. `checked` skips
    (rank list, mesh) pairs already checked: parsed runs and meshes are shared objects, so a model's tensors
    repeat a few pairs.
    """
    from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata

    if len(groups) > 1:
        owners: dict[int, int] = {}
        for index, group in enumerate(groups):
            for rank in group.ranks:
                if owners.setdefault(rank, index) != index:
                    raise ConfigError(f"{where}: rank {rank} is listed in two groups of different layouts")
    for group in groups:
        md = group.sharding_metadata
        mesh = md.mesh_spec.mesh_data if isinstance(md, DTensorShardingMetadata) else None
        key = (id(group.ranks), id(mesh))
        if key in checked:
            continue
        if not group.ranks:  # no rank holds it: the same as no group, which a load took for "not saved"
            raise ConfigError(f"{where}: a sharding group lists no ranks")
        _check_world(where, "rank list", group.ranks, world_size)
        if mesh is not None:
            _check_world(where, "mesh", mesh, world_size)
            if len(set(mesh)) != len(mesh):
                raise ConfigError(f"{where}: its mesh lists a rank twice ({_first_repeat(mesh)})")
            if not set(group.ranks) <= set(mesh):
                outside = sorted(set(group.ranks) - set(mesh))[:5]
                raise ConfigError(f"{where}: ranks {outside} are listed for a layout whose mesh does not hold them")
        checked[key] = None


def _check_world(where: str, what: str, ranks: tuple[int, ...], world_size: int) -> None:
    if ranks and max(ranks) >= world_size:
        raise ConfigError(f"{where}: its {what} names rank {max(ranks)}, but the save had world_size {world_size}")


def _first_repeat(ranks: tuple[int, ...]) -> int | None:
    seen: set[int] = set()
    for rank in ranks:
        if rank in seen:
            return rank
        seen.add(rank)
    return None


@dataclass
class CheckpointMetadata:
    """The gathered metadata of a save (or load) plus this rank's own extracted metadata."""

    distributed_metadata: DistributedMetadata
    local_metadata: dict[str, dict[NestedPath, ShardingMetadata]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.distributed_metadata, DistributedMetadata):
            raise ConfigTypeError(
                f"CheckpointMetadata.distributed_metadata must be a DistributedMetadata, got "
                f"{type(self.distributed_metadata).__name__} {self.distributed_metadata!r:.80}"
            )
        if not isinstance(self.local_metadata, dict) or not all(
            isinstance(v, dict) for v in self.local_metadata.values()
        ):
            raise ConfigTypeError(
                f"CheckpointMetadata.local_metadata must be a dict of item key -> {{nested path: ShardingMetadata}}, "
                f"got {self.local_metadata!r:.80}"
            )


def build_distributed_metadata(
    per_rank: list[dict[str, dict[NestedPath, ShardingMetadata]]],
    rank_to_layouts: list[dict[str, LayoutInfo | None]],
    world_size: int,
) -> DistributedMetadata:
    """Group what each rank extracted (as gathered by all_gather_object) into one DistributedMetadata.

    Ranks reporting equal metadata for a path share one GlobalObjectMetadata, which keeps the file
    small for replicated/DTensor state (one entry per path instead of one per rank).
    """
    if len(per_rank) != world_size or len(rank_to_layouts) != world_size:
        raise ConfigError(
            f"build_distributed_metadata needs one entry per rank: world_size={world_size}, "
            f"got {len(per_rank)} metadata dicts and {len(rank_to_layouts)} layout dicts"
        )
    keys: list[str] = []
    for rank_meta in per_rank:
        for key in rank_meta:
            if key not in keys:
                keys.append(key)
    items: dict[str, DistributedItemMetadata] = {}
    for key in keys:
        paths: dict[NestedPath, list[tuple[ShardingMetadata, list[int]]]] = {}
        for rank, rank_meta in enumerate(per_rank):
            for path, meta in rank_meta.get(key, {}).items():
                groups = paths.setdefault(tuple(path), [])
                for existing, ranks in groups:
                    if existing == meta:
                        ranks.append(rank)
                        break
                else:
                    groups.append((meta, [rank]))
        _check_one_global_tensor(key, paths)
        items[key] = DistributedItemMetadata(
            {p: [GlobalObjectMetadata(m, tuple(r)) for m, r in groups] for p, groups in paths.items()},
            {rank: rank_to_layouts[rank].get(key) for rank in range(world_size)},
        )
    return DistributedMetadata(items, world_size)


def _check_one_global_tensor(key: str, paths: dict[NestedPath, list[tuple[ShardingMetadata, list[int]]]]) -> None:
    """The ranks of one tensor may lay it out differently, but they save one global tensor: ranks whose metadata
    disagree on its global shape or dtype (`DTensor.from_local(..., run_check=False)` with other local shapes,
    a plain tensor of another shape on each rank) are refused at save. Before, the save committed, replacing
    the checkpoint at the id, and every load on another world size called the new one damaged."""
    for path, groups in paths.items():
        if len(groups) < 2:
            continue
        seen = {(tuple(getattr(m, "global_shape", ())), getattr(m, "dtype", None)): ranks for m, ranks in groups}
        if len(seen) < 2:
            continue
        told = "; ".join(f"ranks {ranks[:4]}: {shape} {dtype}" for (shape, dtype), ranks in seen.items())
        raise ConfigError(
            f"Item '{key}' at '{dotted_key(path) or '<item>'}': the ranks save tensors of different global shapes "
            f"or dtypes ({told}), which no resharding load can put back together. Give every rank the same global "
            f"tensor (a DTensor made by DTensor.from_local(..., run_check=False) needs the same local shape on "
            f"every rank, or explicit shape= and stride=); nothing was written."
        )


def load_distributed_metadata(checkpoint_dir: str | Path, storage: Storage) -> DistributedMetadata | None:
    """The checkpoint's metadata.json, or None when it has none (it then holds no resharded item).

    Loads go through `read_distributed_metadata` (verified against the manifest); this serves tools.
    A `storage` that is none (its config, a path) is a `ConfigTypeError`: it was an AttributeError about `exists`.
    A local `~` is the home directory, as a save's id: `"~/run/step_1"` found no file there and said None. A URL
    the storage does not take is refused (`discovery.storage_of`): `file:///abs/step_1` on the local filesystem
    was a relative folder named `file:`, and said None of a checkpoint holding metadata.json.
    """
    # a tool's entry, on top of discovery (no cycle at import)
    from torch_checkpointing.discovery import storage_of, user_path

    if not isinstance(storage, Storage):
        raise _not_a_storage(storage)
    storage_of(checkpoint_dir, storage, "checkpoint_dir")
    path = Path(user_path(checkpoint_dir, storage)) / METADATA_FILE_NAME
    if not storage.exists(path):
        return None
    return parse_distributed_metadata(storage.read(path), str(path))


def _not_a_storage(given: object) -> ConfigTypeError:
    fix = " (call its create_storage())" if isinstance(given, StorageConfig) else ""
    return ConfigTypeError(
        f"load_distributed_metadata needs a Storage, got {type(given).__name__}{fix}; e.g. "
        f"load_distributed_metadata(checkpoint_dir, LocalFileSystemStorageConfig().create_storage())."
    )


def read_distributed_metadata(
    ctx: CheckpointReadContext, keys: Collection[str] | None = None
) -> DistributedMetadata | None:
    """The metadata file the manifest names, read and verified through the load's read context.

    A manifest that names no metadata file means the checkpoint holds no resharded item: None, and any
    `metadata.json` lying there is never read. A named file that is missing is a damaged checkpoint.
    With `keys`, only those items' entries are parsed: the sharding types of items this load does not read
    need not be importable in the loading program.
    """
    if ctx.manifest is None:
        if not ctx.lists(METADATA_FILE_NAME):
            return None
        name = METADATA_FILE_NAME
    else:
        if ctx.manifest.metadata_file is None:
            return None
        name = ctx.manifest.metadata_file
    checked = ctx.check(name, "sharding metadata")
    if checked.size > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{ctx.root / name} is larger than {MAX_METADATA_BYTES} bytes.")
    data, where = ctx.read_bytes(name, "sharding metadata"), str(ctx.root / name)
    if _as_stored.get():
        return parse_distributed_metadata(data, where, keys)
    with unknown_types_as_stored():
        metadata = parse_distributed_metadata(data, where, keys)
    _refuse_unregistered_types(metadata, where)
    return metadata


def _refuse_unregistered_types(metadata: DistributedMetadata, where: str) -> None:
    """A sharding type no imported class registers is the loading program's omission, not damage: a load needs
    the class, so it refuses with a `ConfigError` naming the type and the fix. Before, this read as "metadata.json
    is malformed" (`CorruptCheckpointError`): an operator could delete a healthy checkpoint over a missing import.
    """
    for key, item in metadata.metadata.items():
        for path, groups in item.nested_path_to_metadata.items():
            for group in groups:
                if isinstance(group.sharding_metadata, StoredShardingMetadata):
                    kind = group.sharding_metadata.stored_type
                    available = ", ".join(sorted(ShardingMetadata._registry))
                    raise ConfigError(
                        f"{where}: item {key!r} path {nested_path_to_json(path)} has sharding metadata of type "
                        f"{kind!r}, which no class imported in this program registers (registered: {available}). "
                        "This does not mean the checkpoint is damaged: import the module that defines that "
                        "ShardingMetadata subclass before calling load()."
                    )


def parse_distributed_metadata(data: bytes, where: str, keys: Collection[str] | None = None) -> DistributedMetadata:
    """Validated metadata from untrusted bytes: every defect raises `CorruptCheckpointError` naming the file.

    Nothing named in it is imported: sharding types resolve only against the registry of already-imported
    `ShardingMetadata` subclasses, and a JSON layout's recorded class is dropped (a source file is read for
    its tensors only; the class that rebuilds a JSON item is the one the caller's own config names).
    """
    value = parse_json_bounded(data, where, METADATA_MAX_DEPTH)
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where} is not a JSON object.")
    if keys is not None and isinstance(value.get("metadata"), dict):
        value = {**value, "metadata": {k: v for k, v in value["metadata"].items() if k in keys}}
    try:
        return DistributedMetadata.from_dict(value)
    except CorruptCheckpointError as exc:  # its kind kept: a newer engine's metadata is no damage
        raise type(exc)(f"{where}: {exc}") from None
    except (
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
        RuntimeError,
        OverflowError,
        RecursionError,
    ) as exc:
        # A ConfigError says which field; its type name would have an operator look at their config.
        field = f"field {exc.args[0]!r}: " if isinstance(exc, KeyError) else f"{type(exc).__name__}: "
        field = "" if isinstance(exc, ConfigError) else field
        raise CorruptCheckpointError(f"Sharding metadata {where} is malformed ({field}{exc}).") from None


def _once(key: T, spelling: str, seen: dict[Any, str], where: str) -> T:
    """`key`, parsed from the JSON object key `spelling`, refused when another spelling gave it before: the file's
    duplicate-key check compares the strings, so '["w"]' and '[ "w" ]' (or "0" and "00") passed it, and the dict
    built from them kept the last entry silently."""
    first = seen.setdefault(key, spelling)
    if first != spelling:
        raise CorruptCheckpointError(
            f"field '{where}' names {key!r} twice (as {first!r} and {spelling!r}); a save writes each once, "
            f"so the sharding metadata is damaged or crafted."
        )
    return key


def _rank(text: Any) -> int:
    if not isinstance(text, str) or not (text.isascii() and text.isdigit()):
        raise CorruptCheckpointError(f"rank_to_layout_info key {text!r} is not a rank number")
    return int(text)


def _newer_version(version: object) -> bool:
    """Whether `version` is a `major.minor` string above every version this engine reads (a newer engine's)."""
    if not isinstance(version, str) or re.fullmatch(r"[0-9]{1,9}\.[0-9]{1,9}", version) is None:
        return False
    newest = max(tuple(map(int, v.split("."))) for v in READABLE_METADATA_VERSIONS)
    return tuple(map(int, version.split("."))) > newest


def layout_from_untrusted_dict(d: Any, where: str) -> LayoutInfo:
    """A `LayoutInfo` read from checkpoint data: save-time path rules, one of the four formats, nothing imported."""
    if not isinstance(d, dict) or not isinstance(d.get("serialization_format"), dict):
        raise CorruptCheckpointError(
            f"{where}: a layout must be an object with 'file_path' and 'serialization_format'."
        )
    path = checked_relative_path(d.get("file_path"), f"Sharding metadata {where}")
    if path in _RESERVED_NAMES:
        raise UnsafeCheckpointError(f"Sharding metadata {where}: file path {path!r} names an engine file.")
    fmt = d["serialization_format"]
    kind = fmt.get("type")
    if kind == "JsonSerialization":
        return LayoutInfo(path, JsonSerialization())
    if kind == "SafetensorsSerialization":
        meta = fmt.get("metadata")
        if meta is not None and (
            not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
        ):
            raise CorruptCheckpointError(f"Sharding metadata {where}: safetensors metadata must map str to str.")
        return LayoutInfo(path, SafetensorsSerialization(metadata=meta))
    simple = {"TorchSerialization": TorchSerialization, "RawSerialization": RawSerialization}.get(str(kind))
    if simple is None:
        raise unknown_to_this_engine(f"Sharding metadata {where}", "the serialization format", kind)
    return LayoutInfo(path, simple())


_RESERVED_NAMES = frozenset({"manifest.json", METADATA_FILE_NAME, ".incomplete"})


def _register_builtin_types() -> None:
    """Register the engine's own metadata types (their modules register on import; the package imports lazily).

    Only this fixed module is imported, never a name read from checkpoint data."""
    import torch_checkpointing.dtensor_metadata  # noqa: F401
