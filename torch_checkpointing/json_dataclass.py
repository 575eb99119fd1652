"""JSON <-> dataclass conversion for `JsonSerialization(cls=...)`."""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections import abc
from collections.abc import Mapping
from typing import Any

__all__ = ["RebuildGaps", "from_jsonable", "to_jsonable"]


def to_jsonable(value: Any) -> Any:
    """Dataclass instances and every Mapping become dicts, lists and tuples lists (recursively); leaves are
    left to `json`, which refuses what it cannot write."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


@dataclasses.dataclass
class RebuildGaps:
    """Where a rebuild and the JSON disagreed without failing: keys no field takes (`ignored`), and fields the
    JSON lacks that got their default, or None (`defaulted`); nested paths, so a load can name them."""

    ignored: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    defaulted: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)


def from_jsonable(tp: Any, data: Any, where: str, gaps: RebuildGaps | None = None, at: tuple[Any, ...] = ()) -> Any:
    """Rebuild `tp` from decoded JSON: dataclasses and NamedTuples (nested, optional, in lists and dicts) are
    reconstructed.

    A JSON key no field of its dataclass takes is ignored, and a field the JSON lacks takes its default (None if
    optional), as the published release does; `gaps`, when given, receives their nested paths (`at` is where
    `data` sits), so a load can name what it did not restore."""
    ignored = gaps.ignored if gaps is not None else None
    tp, optional = _strip_optional(tp)
    if data is None and optional:
        return None
    tp, bound = _generic_dataclass(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object for {tp.__name__}, got {type(data).__name__}")
        hints = {name: _bind(hint, bound) for name, hint in _type_hints(tp, where).items()}
        kwargs: dict[str, Any] = {}
        fields = [f for f in dataclasses.fields(tp) if f.init]
        if ignored is not None:
            taken = {f.name for f in dataclasses.fields(tp)}  # a field(init=False) is written, and rebuilt by the class
            ignored.extend((*at, k) for k in data if k not in taken)
        for f in fields:
            if f.name in data:
                hint = hints.get(f.name, Any)
                kwargs[f.name] = from_jsonable(hint, data[f.name], f"{where}.{f.name}", gaps, (*at, f.name))
                continue
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                if _strip_optional(hints.get(f.name, Any))[1]:
                    kwargs[f.name] = None
                else:
                    raise ValueError(f"{where}: missing required field {f.name!r} of {tp.__name__}")
            if gaps is not None:
                gaps.defaulted.append((*at, f.name))
        return tp(**kwargs)
    if _is_named_tuple(tp) and isinstance(data, list):
        return _named_tuple(tp, data, where, gaps, at)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple and isinstance(data, list) and args and not (len(args) == 2 and args[1] is Ellipsis):
        return _fixed_tuple(args, data, where, gaps, at)
    origin = _ABSTRACT_CONTAINERS.get(origin, origin)
    if origin in (list, tuple, set, frozenset) and isinstance(data, list):
        inner = args[0] if args else Any
        items = [from_jsonable(inner, v, f"{where}[{i}]", gaps, (*at, i)) for i, v in enumerate(data)]
        return origin(items)
    if origin is dict and isinstance(data, dict) and len(args) == 2:
        return {k: from_jsonable(args[1], v, f"{where}[{k!r}]", gaps, (*at, k)) for k, v in data.items()}
    if isinstance(tp, type) and tp is not Any and not isinstance(data, tp):
        return _exact_leaf(tp, data, where)
    return data


def _type_hints(tp: type, where: str) -> dict[str, Any]:
    """`tp`'s field annotations, resolved: a string one (`from __future__ import annotations`) naming a type its
    module does not hold (a class defined in a function) is a ValueError naming the class, not a bare NameError."""
    try:
        return typing.get_type_hints(tp)
    except NameError as exc:
        raise ValueError(
            f"{where}: the annotations of {tp.__qualname__} cannot be resolved ({exc}): a string annotation names "
            f"a type module {tp.__module__} does not define at its top level. Define that type at module level."
        ) from exc


def _generic_dataclass(tp: Any) -> tuple[Any, dict[Any, Any]]:
    """`Box[Inner]` as the dataclass `Box` and its type variables bound (`{T: Inner}`); any other `tp` as
    itself, nothing bound."""
    origin = typing.get_origin(tp)
    if not (isinstance(origin, type) and dataclasses.is_dataclass(origin)):
        return tp, {}
    params = getattr(origin, "__parameters__", ())
    return origin, dict(zip(params, typing.get_args(tp), strict=False))


def _bind(hint: Any, bound: dict[Any, Any]) -> Any:
    """A field's annotation with the type variables its generic dataclass was given (`list[T]` as
    `list[Inner]`); one left unbound is `Any`, as for a dataclass used without parameters."""
    if isinstance(hint, typing.TypeVar):
        return bound.get(hint, Any)
    params = getattr(hint, "__parameters__", ())
    if not bound or not params:
        return hint
    return hint[tuple(bound.get(p, Any) for p in params)]


# Annotations that name an abstract container: JSON gives a list or an object, rebuilt as the concrete type.
_ABSTRACT_CONTAINERS: dict[Any, type] = {
    abc.Sequence: list,
    abc.MutableSequence: list,
    abc.Mapping: dict,
    abc.MutableMapping: dict,
}


def _fixed_tuple(
    args: tuple[Any, ...], data: list[Any], where: str, gaps: RebuildGaps | None, at: tuple[Any, ...]
) -> tuple[Any, ...]:
    """`tuple[A, B]` from its JSON list: each position rebuilt by its own annotation."""
    if len(args) != len(data):
        raise ValueError(f"{where}: {len(data)} JSON values for a tuple of {len(args)} ({', '.join(map(str, args))})")
    return tuple(
        from_jsonable(a, v, f"{where}[{i}]", gaps, (*at, i)) for i, (a, v) in enumerate(zip(args, data, strict=True))
    )


def _is_named_tuple(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields")


def _named_tuple(tp: Any, data: list[Any], where: str, gaps: RebuildGaps | None, at: tuple[Any, ...]) -> Any:
    """A NamedTuple from the JSON list `json` wrote for it: its fields are positional (`tp(*values)`, never
    `tp(list)`), each rebuilt by its annotation; fields past the end of the list take their defaults."""
    names: tuple[str, ...] = tp._fields
    if len(data) > len(names):
        raise ValueError(f"{where}: {len(data)} JSON values for the {len(names)} fields of {tp.__name__} {names}")
    hints = _type_hints(tp, where)
    values = [
        from_jsonable(hints.get(name, Any), v, f"{where}.{name}", gaps, (*at, i))
        for i, (name, v) in enumerate(zip(names, data, strict=False))
    ]
    absent = names[len(data) :]
    required = [name for name in absent if name not in tp._field_defaults]
    if required:
        raise ValueError(f"{where}: missing required field(s) {required} of {tp.__name__}")
    if gaps is not None:
        gaps.defaulted.extend((*at, len(data) + i) for i in range(len(absent)))
    return tp(*values)


def _exact_leaf(tp: type, data: Any, where: str) -> Any:
    """`data` as the annotated type `tp` where that gives back exactly the JSON value (an IntEnum from its int,
    a str subclass from its str); an int stays an int under a float annotation (PEP 484's numeric tower accepts
    it, so it was saved as one). Any other conversion would change the value (`int(2.7)` is 2, `bool("false")`
    is True, `str(5)` is "5"), so it is a ValueError naming the field instead."""
    if type(data) is int and tp in (float, complex):
        return data
    if isinstance(data, (int, float)) and not issubclass(tp, (int, float, complex, enum.Enum)):
        # Never handed to another type: `bytearray(n)`, `bytes(n)`, `torch.Tensor(n)` read a number as a size,
        # and a crafted file's 2**40 would be allocated (no such type gives back the same JSON number anyway).
        raise ValueError(
            f"{where}: the field is annotated {tp.__name__}, but its JSON value {data!r} is a number, which "
            f"is rebuilt only as a number or an Enum member."
        )
    try:
        value = tp(data)
    except Exception as exc:
        raise ValueError(f"{where}: cannot build {tp.__name__} from JSON value {data!r}: {exc}") from exc
    if not _same_json(value, data):
        raise ValueError(
            f"{where}: the field is annotated {tp.__name__}, but its JSON value {data!r} is a "
            f"{type(data).__name__}, and {tp.__name__}({data!r}) is {value!r}, a different value."
        )
    return value


def _same_json(value: Any, data: Any) -> bool:
    try:
        return bool(json.dumps(to_jsonable(value)) == json.dumps(data))
    except (TypeError, ValueError):
        return False
