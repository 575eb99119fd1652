"""Type aliases and small value types shared by every module."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

NestedPath = tuple[str | int, ...]
ItemKey: TypeAlias = str
STATE_DICT: TypeAlias = Mapping[str, Any]


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the job; `role_*` equals `global_*` for plain jobs. Frozen: a barrier keeps the
    object it was given, and a field assigned after the checks below (`role_rank = True`, a rank past its world)
    reached it unchecked; `dataclasses.replace` makes another, checked."""

    global_rank: int
    global_world_size: int
    role_rank: int
    role_world_size: int

    def __post_init__(self) -> None:
        """Four ints, each rank inside its world, an integer scalar taken as its int: `True` equals 1 but is
        named "True", and a barrier built with `RankInfo(True, 2, True, 2)` published its arrival under `0/True`
        while rank 0 waited for `0/1`, until both timed out naming rank 1 as never arrived."""
        from torch_checkpointing.config import integer_as_int
        from torch_checkpointing.errors import ConfigError, ConfigTypeError

        for name in ("global_rank", "global_world_size", "role_rank", "role_world_size"):
            value = integer_as_int(getattr(self, name))
            if type(value) is not int:
                raise ConfigTypeError(f"RankInfo.{name} must be an int, got {type(value).__name__} {value!r:.80}")
            object.__setattr__(self, name, value)  # frozen: the checked value in place of the one given
        for rank, world in (("global_rank", "global_world_size"), ("role_rank", "role_world_size")):
            if not 0 <= getattr(self, rank) < getattr(self, world):
                raise ConfigError(
                    f"RankInfo.{rank}={getattr(self, rank)} is outside its world (RankInfo.{world}="
                    f"{getattr(self, world)}): a rank is 0 to world size - 1."
                )

    @classmethod
    def single(cls) -> RankInfo:
        """Rank 0 of a one-process job."""
        return cls(0, 1, 0, 1)


@dataclass(frozen=True, slots=True)
class CheckpointPath:
    """One location inside a checkpoint: an item key plus a path inside its value."""

    item_key: str
    nested_path: NestedPath = ()

    def __post_init__(self) -> None:
        """Refuse a key or path of the wrong type naming it: a list path made a location that did not hash, an int
        key a bare TypeError from `str()`. A list path is taken as the tuple it stands for. A component is any
        hashable dict key or an int index: a value's dict keys may be bools, floats, None or tuples, and the engine
        names their locations with them (refusing them refused every save and load of such a value)."""
        path = self.nested_path
        if type(self.item_key) is str and type(path) is tuple and all(type(c) is str or type(c) is int for c in path):
            return  # the engine's own locations: checked in C, one per leaf of every load
        from torch_checkpointing.errors import ConfigTypeError

        if not isinstance(self.item_key, str):
            raise ConfigTypeError(
                f"CheckpointPath.item_key must be a str, got {type(self.item_key).__name__} {self.item_key!r:.80}"
            )
        object.__setattr__(self, "nested_path", checked_nested_path(path, "CheckpointPath.nested_path"))

    def __str__(self) -> str:
        if not self.nested_path:
            return self.item_key
        return f"{self.item_key}::" + ".".join(str(c) for c in self.nested_path)

    def serialize(self) -> str:
        """Compact JSON `["item", "a", 0]`: unambiguous where `str()` is not (keys may contain dots). A tuple
        component is a JSON list; a component JSON cannot give back (a frozenset, bytes) is a `ConfigError`."""
        from torch_checkpointing.errors import ConfigError

        for c in self.nested_path:
            if not json_component(c) and holds_nan(c):
                raise ConfigError(
                    f"CheckpointPath.serialize: component {c!r:.80} of {self} holds NaN, which equals nothing (not "
                    f"even itself), so no location is named by it; rename that dict key (e.g. to the str 'nan')."
                )
            if not json_component(c):
                raise ConfigError(
                    f"CheckpointPath.serialize: component {c!r:.80} ({type(c).__name__}) of {self} has no JSON form "
                    f"that deserialize() gives back; only str, int, float (not NaN), bool, None and tuples of them do."
                    f"{conversion_hint(c) or ' Name such a location with str() instead.'}"
                )
        return json.dumps([self.item_key, *self.nested_path], separators=(",", ":"))

    @classmethod
    def deserialize(cls, s: str) -> CheckpointPath:
        """The inverse of `serialize()`; an empty list is a `ValueError`, and so is any JSON `serialize()` never
        writes (not a list, a non-str item key, an object component) or text that is no JSON: a `ConfigError`
        naming it (no JSON was a bare JSONDecodeError). No str is a `ConfigTypeError`. A JSON list component is
        the tuple key it was written from."""
        from torch_checkpointing.errors import ConfigError, ConfigTypeError

        expected = (
            "expected what serialize() writes, a JSON list of the str item key then the path's keys and indices: "
            'str, int, float, bool, null or lists of them (e.g. ["model", "state", 0, "exp_avg"])'
        )
        if not isinstance(s, str):
            raise ConfigTypeError(
                f"CheckpointPath.deserialize takes the str {expected}; got {type(s).__name__} {s!r:.80}"
            )
        try:
            parts = json.loads(s)
        except (json.JSONDecodeError, RecursionError) as exc:  # no JSON, or nested past the parser's depth
            raise ConfigError(
                f"Cannot deserialize CheckpointPath from {s!r:.200}: it is no JSON ({exc}); {expected}"
            ) from None
        if isinstance(parts, list) and not parts:
            raise ConfigError(f'Cannot deserialize CheckpointPath from empty list: {s!r}; expected ["item", ...]')
        try:  # components nested past what the checks recurse through: a bare RecursionError before
            if isinstance(parts, list) and isinstance(parts[0], str) and all(map(json_component, parts[1:])):
                return cls(parts[0], tuple(tuples_from_json(c) for c in parts[1:]))
        except RecursionError:
            pass
        raise ConfigError(f"Cannot deserialize CheckpointPath from {s!r:.200}: {expected}")


def json_component(c: object) -> bool:
    """Whether JSON carries `c` and gives it back: a scalar, or a tuple (a list once parsed) of such. The one rule
    for a path component written as JSON: `CheckpointPath.serialize` and metadata.json's nested paths. A NaN is
    none: `NaN` is no JSON, and read back it is a new float, equal to no key (the one saved under included): a
    DTensor saved under `float("nan")` loaded as a second `nan` key beside the template's, left unfilled (inf is
    written `Infinity`, which Python's reader gives back equal; metadata.json, strict JSON, refuses it at save:
    `holds_infinity`)."""
    if c is None or isinstance(c, (str, int)):
        return True
    if isinstance(c, float):
        return c == c
    return isinstance(c, (tuple, list)) and all(map(json_component, c))


def conversion_hint(c: object) -> str:
    """The conversion that makes a path component one JSON records, as a sentence ('' when none helps): numpy's
    scalars (`np.int64`, `np.float32`, `np.bool_`: no int, float or bool) are what a key taken from an array is,
    and the refusal listing the types taken left the fix, `int(key)`, to be guessed."""
    if isinstance(c, (tuple, list)):
        return next(filter(None, map(conversion_hint, c)), "")
    kind = type(c)
    if json_component(c) or not (isinstance(c, numbers.Number) or kind.__module__ == "numpy"):
        return ""
    try:
        plain = c.item()  # type: ignore[attr-defined]
    except Exception:
        return ""
    if type(plain) not in (bool, int, float) or not json_component(plain):
        return ""
    name = type(plain).__name__
    return f" Convert the key {c!r:.40} to the {name} it stands for with {name}(key) (a {kind.__name__} is no {name})."


def holds_nan(c: object) -> bool:
    """Whether a path component is or holds a NaN (a tuple key may hold one): a float's, or any other real
    number's, such as numpy's `float32` (no float) and `float64` (a float subclass), unequal to itself as well."""
    if isinstance(c, float) or (isinstance(c, numbers.Real) and not isinstance(c, numbers.Integral)):
        return bool(c != c)
    return isinstance(c, (tuple, list)) and any(map(holds_nan, c))


def holds_infinity(c: object) -> bool:
    """Whether a path component is or holds an infinite float: JSON has no infinity (Python writes the bare token
    `Infinity`, which strict parsers refuse), so a file we write must not record one."""
    if isinstance(c, float):
        return c in (math.inf, -math.inf)
    return isinstance(c, (tuple, list)) and any(map(holds_infinity, c))


def tuples_from_json(c: Any) -> Any:
    """A parsed component with its lists as the tuple keys they were written from (a list is no dict key)."""
    return tuple(tuples_from_json(x) for x in c) if isinstance(c, list) else c


def checked_nested_path(path: object, what: str) -> NestedPath:
    """`path` as the tuple it stands for (a list is taken as its tuple), or a `ConfigTypeError` naming `what`, the
    value and the fix. The one check of every record that holds a nested path: `CheckpointPath`, `ReshardingInfo`
    and `DistributedItemMetadata` each had their own, and they disagreed on a list. A component is any hashable
    dict key or an int index: a value's dict keys may be bools, floats, None or tuples."""
    if isinstance(path, (tuple, list)):
        bad = [c for c in path if not hashable(c)]
        if not bad:
            return tuple(path)
        why = f": component {bad[0]!r:.40} ({type(bad[0]).__name__}) can be no dict key"
    else:
        why = " (a str is no path: ('w',), not 'w')" if isinstance(path, str) else ""
    from torch_checkpointing.errors import ConfigTypeError

    raise ConfigTypeError(
        f"{what} must be a nested path, a tuple of the dict keys and int indices that lead to the value, such as "
        f"('layers', 0, 'w'); got {type(path).__name__} {path!r:.80}{why}"
    )


def check_path_map(value: object, what: str, kind: type) -> None:
    """`value` is a dict of nested path -> list of `kind` (what a record's per-path field holds), or a
    `ConfigTypeError` naming `what` (`Record.field`), the entry and what it must be."""
    from torch_checkpointing.errors import ConfigTypeError

    if not isinstance(value, dict):
        raise ConfigTypeError(
            f"{what} must be a dict of nested path -> list of {kind.__name__}, got {type(value).__name__} {value!r:.80}"
        )
    for path, entries in value.items():
        checked_nested_path(path, f"{what} key")
        if not isinstance(entries, list) or not all(isinstance(e, kind) for e in entries):
            raise ConfigTypeError(
                f"{what}[{path!r}] must be a list of {kind.__name__}, got {type(entries).__name__} {entries!r:.80}"
            )


def hashable(component: object) -> bool:
    """Whether `component` can be a dict key (a nested path's component)."""
    try:
        hash(component)
    except TypeError:
        return False
    return True
