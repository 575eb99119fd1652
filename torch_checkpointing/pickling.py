"""Naming the value a save cannot pickle or deep-copy: the item, the nested path, the type, and the fix.

`torch.save`, `copy.deepcopy` or `pickle.dumps` of a whole item fails with the innermost object's complaint
("cannot pickle '_thread.lock' object") and not a word of where it sits. Every place a save pickles or copies
an item reports through `unpicklable`, which looks for the culprit only once the whole operation has failed,
so the common path pays nothing.
"""

from __future__ import annotations

import functools
import io
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torch_checkpointing.traversal import dotted_key, iter_leaves
from torch_checkpointing.types import NestedPath

__all__ = ["dumps_value", "plain_pickle_keeps", "unpicklable"]


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


def dumps_value(value: Any) -> bytes:
    """Pickle bytes of `value` that `pickle.loads` gives back whole in another process, for a value that travels
    to the writer process as it is (requires_copy=False). Plain pickling writes a tensor's storage in torch's
    legacy format, whose loader has no storage class for uint16/32/64, the float8 types, complex32 and the bits
    types (a bare `AttributeError: ... UntypedStorage ... has no attribute 'dtype'` in the writer): such a tensor
    travels as `torch.save` bytes instead, which hold every dtype torch can name. Nothing is put in shared
    memory: the caller's tensors are left where they are."""
    buffer = io.BytesIO()
    _WholePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


class _WholePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not plain_pickle_keeps(obj.dtype):
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            return _tensor_from_torch_bytes, (buffer.getvalue(),)
        return NotImplemented


def _tensor_from_torch_bytes(data: bytes) -> torch.Tensor:
    """The tensor `dumps_value` wrote as `torch.save` bytes (the engine's own bytes, read back by itself)."""
    tensor: torch.Tensor = torch.load(io.BytesIO(data), weights_only=False)
    return tensor


@functools.cache
def plain_pickle_keeps(dtype: torch.dtype) -> bool:
    """Whether `pickle.loads(pickle.dumps(t))` gives a tensor of `dtype` back: asked of torch itself, once per
    dtype (its legacy storage table and its dtypes do not grow in step)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is "experimental"
            back = pickle.loads(pickle.dumps(torch.empty(0, dtype=dtype)))
    except Exception:
        return False
    return bool(back.dtype == dtype)
