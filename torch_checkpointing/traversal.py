"""Walking nested state: which values are containers, how a position is named, and what a DTensor holds here.

Every module that visits a state tree goes through this one, so that the save side, the load side, the
resharders and the exporters agree on three rules:

* containers are any `Mapping` (children in `items()` order) and `list`/`tuple` (children by index, named
  tuples and `torch.Size` included); everything else is a leaf, tensors and DTensors too, and so are other
  sequences and sets (a `UserList`, a `deque`, a `range`, a `set`, a `str`): the save stores such a value whole,
  and the load's merge into a template (`walk_utils`) replaces it whole;
* a position's dotted key joins its path components with `.`, with no leading dot while the key so far is
  empty. This is an on-disk contract: safetensors files are keyed by it, so it must never change;
* a DTensor's data on this rank is its local shard (`local_tensor`), read through DTensor's public API.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from torch_checkpointing.types import NestedPath

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "any_leaf",
    "children",
    "dotted_key",
    "flatten",
    "get_path",
    "is_container",
    "is_dtensor",
    "is_sequence",
    "iter_leaves",
    "join_key",
    "local_tensor",
    "map_leaves",
    "rebuild",
]

_SEQUENCES = (list, tuple)
"""The sequences the walk descends into; any other Sequence is a leaf (see the module docstring)."""
_CONTAINERS = (Mapping, *_SEQUENCES)


def is_container(value: Any) -> bool:
    """Whether the walk descends into `value` (a Mapping, list or tuple)."""
    return isinstance(value, _CONTAINERS)


def is_sequence(value: Any) -> bool:
    """Whether `value` is a container whose children are indexed (a list or tuple, named tuples included)."""
    return isinstance(value, _SEQUENCES)


def children(value: Any) -> Iterable[tuple[Any, Any]]:
    """`(key or index, child)` pairs of a container, in order; nothing for a leaf."""
    if isinstance(value, Mapping):
        return value.items()
    if isinstance(value, _SEQUENCES):
        return enumerate(value)
    return ()


def iter_leaves(value: Any, path: NestedPath = ()) -> Iterator[tuple[NestedPath, Any]]:
    """`(path, leaf)` for every leaf under `value`, depth first in container order. Empty containers yield
    nothing; a bare leaf yields itself at `path`."""
    if not is_container(value):
        yield path, value
        return
    for k, v in children(value):
        yield from iter_leaves(v, (*path, k))


def leaves(value: Any) -> Iterator[Any]:
    """Every leaf under `value`, in `iter_leaves` order, without building paths (the staging copy's hot path)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, _SEQUENCES):
            stack.extend(reversed(node))
        else:
            yield node


def join_key(prefix: str, part: object) -> str:
    """One step of the dotted-key rule: `prefix.part`, or `part` alone while `prefix` is empty."""
    return f"{prefix}.{part}" if prefix else str(part)


def dotted_key(path: NestedPath) -> str:
    """The dotted key of a nested path (`("a", 0, "b")` -> `"a.0.b"`, `()` -> `""`): the name safetensors
    files store the leaf under."""
    return functools.reduce(join_key, path, "")


def flatten(value: Any, keep: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """Every leaf (or every leaf `keep` accepts) under its dotted key, DTensors as their local shards.

    Dotted keys of distinct paths can be equal (a dict key holding a dot): the later leaf wins here; the
    safetensors encoder refuses such a tree instead.
    """
    return {dotted_key(path): local_tensor(leaf) for path, leaf in iter_leaves(value) if keep is None or keep(leaf)}


def get_path(value: Any, path: NestedPath, default: Any = None) -> Any:
    """The value at `path`, or `default` where a component is absent (a missing key, an index out of range, a
    non-int index into a list, a path running through a leaf)."""
    node = value
    for comp in path:
        if isinstance(node, Mapping):
            if comp not in node:
                return default
            node = node[comp]
        elif isinstance(node, _SEQUENCES) and isinstance(comp, int) and -len(node) <= comp < len(node):
            node = node[comp]
        else:
            return default
    return node


def any_leaf(value: Any, pred: Callable[[Any], bool]) -> bool:
    """Whether `pred` holds for some leaf (stops at the first)."""
    return any(pred(leaf) for leaf in leaves(value))


def map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    """`value` with containers rebuilt and `fn` applied to every leaf.

    Plain dicts, lists and tuples come back as such; other containers (OrderedDict, named tuples, custom
    Mappings) keep their type where it can be rebuilt from its items, else become a dict or list (`rebuild`).
    """
    if isinstance(value, Mapping):
        items = {k: map_leaves(v, fn) for k, v in value.items()}
        return items if type(value) is dict else rebuild(value, items)
    if isinstance(value, _SEQUENCES):
        items_list = [map_leaves(v, fn) for v in value]
        return type(value)(items_list) if type(value) in _SEQUENCES else rebuild(value, items_list)
    return fn(value)


def rebuild(original: Any, items: dict[Any, Any] | list[Any]) -> Any:
    """A container of `original`'s type holding `items` (a dict for a Mapping, a list for a sequence).

    Named tuples take their fields positionally, everything else its items as one argument; a type that
    cannot be built that way (a Mapping taking keywords) comes back as a dict or list, so every walk of the
    tree returns the same types.
    """
    try:
        if isinstance(original, tuple) and hasattr(original, "_fields"):
            return type(original)(*items)
        return type(original)(items)
    except Exception:  # a container type that cannot be built from its items: the plain equivalent serves
        return dict(items) if isinstance(items, dict) else list(items)


def _dtensor_type() -> type | None:
    """DTensor's class once its module is loaded; until then no DTensor can exist, so none is looked for.

    Importing `torch.distributed.tensor` costs about a second (it pulls in sympy): a load, a staging copy or
    the writer process that holds no DTensor must not pay it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether `value` is a DTensor (False where this torch build has no distributed support)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(value, dtensor)


def local_tensor(value: Any) -> Any:
    """A DTensor's local shard (the tensor sharing its memory, not a copy); any other value unchanged.

    `to_local()` under no_grad is the DTensor's own local tensor: no autograd view is built, so what the
    caller copies into or out of is the shard itself.
    """
    if not is_dtensor(value):
        return value
    with torch.no_grad():
        return value.to_local()
