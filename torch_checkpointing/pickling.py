"""Naming the value a save cannot pickle or deep-copy: the item, the nested path, the type, and the fix.

`torch.save`, `copy.deepcopy` or `pickle.dumps` of a whole item fails with the innermost object's complaint
("cannot pickle '_thread.lock' object") and not a word of where it sits. Every place a save pickles or copies
an item reports through `unpicklable`, which looks for the culprit only once the whole operation has failed,
so the common path pays nothing.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from torch_checkpointing.traversal import dotted_key, iter_leaves
from torch_checkpointing.types import NestedPath

__all__ = ["unpicklable"]


def unpicklable(
    key: str, value: Any, exc: BaseException, *, doing: str, op: Callable[[Any], object], fix: str
) -> pickle.PicklingError:
    """The error for item `key` whose `value` failed `op` (raising `exc`) while being `doing`, with `fix`."""
    found = _first_failing_leaf(value, op)
    if found is None:  # a container itself, or a failure no single leaf shows
        return pickle.PicklingError(f"Item '{key}' cannot be {doing}: {type(exc).__name__}: {exc}. {fix}")
    path, leaf, leaf_exc = found
    where = f"{key}::{dotted_key(path)}" if path else key
    return pickle.PicklingError(
        f"Item '{key}' cannot be {doing}: the value at '{where}' (a {_kind(leaf)}) fails: "
        f"{type(leaf_exc).__name__}: {leaf_exc}. {fix}"
    )


def _kind(leaf: Any) -> str:
    return f"Tensor of dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__


def _first_failing_leaf(value: Any, op: Callable[[Any], object]) -> tuple[NestedPath, Any, Exception] | None:
    """The first leaf (depth first) on which `op` raises. A tensor is tried as an empty tensor of its dtype,
    once per dtype: its data is never the culprit (and pickling it to find out would copy it), but its dtype
    can be one torch.save has no name for (uint1..uint7, int1..int7: a bare `KeyError` before)."""
    tried: set[torch.dtype] = set()
    for path, leaf in iter_leaves(value):
        probe = _dtype_probe(leaf, tried)
        if probe is None:
            continue
        try:
            op(probe)
        except Exception as exc:
            return path, leaf, exc
    return None


def _dtype_probe(leaf: Any, tried: set[torch.dtype]) -> Any:
    """What to try `op` on for `leaf`: itself, an empty tensor of a dtype not yet tried, or None (skip it)."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if leaf.dtype in tried or leaf.layout != torch.strided or leaf.is_quantized:
        return None
    tried.add(leaf.dtype)
    return torch.empty(0, dtype=leaf.dtype)
