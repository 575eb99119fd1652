"""Merging a loaded value into a caller's template (`into=`), in place wherever the template allows.

Tensors are filled with `copy_()` so the caller's objects (model parameters, optimizer state) keep their
identity; nothing is resized or cast silently.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence, Set
from typing import Any

import torch

from torch_checkpointing.types import CheckpointPath, NestedPath

__all__ = ["MISSING", "walk_checkpoint_structure", "copy_tensor_into"]


class _Missing:
    """A leaf the source does not have (safetensors list/tuple parents); comes back as None."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
_STRINGS = (str, bytes, bytearray)

LeafFn = Callable[[CheckpointPath, Any, Any], Any]


def _is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and hasattr(x, "to_local")


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if _is_dtensor(x) else x


def copy_tensor_into(where: CheckpointPath, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`target.copy_(source)` after checking shape and dtype; DTensors are copied through their local shards."""
    src, dst = _local(source), _local(target)
    if src.shape != dst.shape:
        raise RuntimeError(
            f"Shape mismatch at {where}: checkpoint holds {tuple(src.shape)}, template has {tuple(dst.shape)}. "
            f"Build the template with the saved shape (or reshard with a Resharder); nothing is resized."
        )
    if src.dtype != dst.dtype:
        raise RuntimeError(
            f"Dtype mismatch at {where}: checkpoint holds {src.dtype}, template has {dst.dtype}. "
            f"Load into a template of the saved dtype and convert afterwards."
        )
    with torch.no_grad():
        dst.copy_(src)
    return target


def _compatible(template: Any, source: Any) -> bool:
    if isinstance(template, Mapping):
        return isinstance(source, Mapping)
    if isinstance(template, Set):
        return isinstance(source, Set)
    if isinstance(template, Sequence) and not isinstance(template, _STRINGS):
        return isinstance(source, Sequence) and not isinstance(source, _STRINGS)
    if isinstance(template, numbers.Number) and isinstance(source, numbers.Number):
        return isinstance(template, bool) == isinstance(source, bool)
    return isinstance(template, type(source)) or isinstance(source, type(template))


def walk_checkpoint_structure(
    *,
    item_key: str,
    source: Any,
    target: Any = None,
    leaf_fn: LeafFn | None = None,
) -> tuple[Any, list[CheckpointPath]]:
    """Merge `source` into `target`; returns the merged value and the template paths the source lacked."""
    missing: list[CheckpointPath] = []
    merged = _merge(item_key, (), source, target, missing, leaf_fn)
    return merged, missing


def _merge(key: str, path: NestedPath, source: Any, target: Any, missing: list[CheckpointPath], leaf_fn: LeafFn | None) -> Any:
    here = CheckpointPath(key, path)
    if source is MISSING:
        missing.append(here)
        return None
    if target is None:
        return source
    if isinstance(target, torch.Tensor):
        if not isinstance(source, torch.Tensor):
            raise _type_error(here, target, source)
        if leaf_fn is not None:
            return leaf_fn(here, source, target)
        return copy_tensor_into(here, source, target)
    if not _compatible(target, source):
        raise _type_error(here, target, source)
    if isinstance(target, Mapping):
        out: MutableMapping[Any, Any] = target if isinstance(target, MutableMapping) else dict(target)
        for k in list(target.keys()):
            if k in source:
                out[k] = _merge(key, (*path, k), source[k], target[k], missing, leaf_fn)
            else:
                missing.append(CheckpointPath(key, (*path, k)))
        return out
    if isinstance(target, Sequence) and not isinstance(target, _STRINGS):
        if len(target) == 0:
            return source
        merged = [
            _merge(key, (*path, i), source[i], t, missing, leaf_fn) if i < len(source) else _record(missing, key, path, i, t)
            for i, t in enumerate(target)
        ]
        if isinstance(target, MutableSequence):
            for i, value in enumerate(merged):
                target[i] = value
            return target
        if isinstance(target, tuple) and hasattr(target, "_fields"):
            return type(target)(*merged)
        return type(target)(merged)
    if leaf_fn is not None:
        return leaf_fn(here, source, target)
    return source


def _record(missing: list[CheckpointPath], key: str, path: NestedPath, index: int, keep: Any) -> Any:
    missing.append(CheckpointPath(key, (*path, index)))
    return keep


def _type_error(where: CheckpointPath, target: Any, source: Any) -> RuntimeError:
    return RuntimeError(
        f"Target value at nested_path={where.nested_path!r} of item '{where.item_key}' is set to "
        f"{type(target).__name__}, but source value is {type(source).__name__}. Pass a template of the saved "
        f"type, or None to take the stored value as is."
    )
