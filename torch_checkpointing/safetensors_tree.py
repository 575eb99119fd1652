"""Flattening nested tensor containers to safetensors' flat `name -> tensor` map, and re-nesting on read."""

from __future__ import annotations

import bisect
import functools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torch_checkpointing.errors import ConfigError, TemplateMismatchError
from torch_checkpointing.staging import freed_refusal, tensor_for_write
from torch_checkpointing.traversal import (
    dotted_key,
    is_dense_data,
    is_sequence,
    iter_leaves,
    join_key,
    local_tensor,
    storage_freed,
)
from torch_checkpointing.types import NestedPath
from torch_checkpointing.walk_utils import MISSING

__all__ = [
    "RESERVED_NAME",
    "flatten_tensors",
    "named_leaves",
    "same_name_error",
    "stores_dtype",
    "unflatten_for_caller",
    "unflatten_to_target",
]

RESERVED_NAME = "__metadata__"
"""The header entry safetensors keeps for the file's str->str metadata: no tensor may take that name."""


def flatten_tensors(data: Any, item_key: str = "") -> dict[str, torch.Tensor]:
    """Dotted keys for every tensor leaf; DTensors become their local shard; every tensor contiguous."""
    flat: dict[str, torch.Tensor] = {}
    seen_storage: set[tuple[int, int]] = set()
    for name, value in named_leaves(data, item_key):
        value = _storable(join_key(item_key, name) if name else item_key, name, value)
        storage_id = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
        if value.numel() and storage_id in seen_storage:
            value = value.clone()  # safetensors refuses tensors that share memory (tied weights)
        seen_storage.add(storage_id)
        flat[name] = value
    return flat


def named_leaves(data: Any, item_key: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf with the dotted name a file gives it; two paths that one name would hold are refused."""
    paths: dict[str, NestedPath] = {}
    for path, value in iter_leaves(data):
        name = dotted_key(path)
        if name in paths:
            raise same_name_error(item_key, name, paths[name], path)
        _refuse_non_utf8(item_key, name)
        paths[name] = path
        yield name, value


def _refuse_non_utf8(item_key: str, name: str) -> None:
    """A name holding a lone surrogate (one a str decoded with surrogateescape or surrogatepass carries): a
    safetensors file's names are UTF-8, and the save failed with a bare UnicodeEncodeError naming nothing."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"SafetensorsSerialization cannot store item '{item_key}': its key {name!r} holds {name[exc.start]!r}, "
            f"a lone surrogate, and a safetensors file's names are UTF-8. Rename the dict key, or use "
            f"TorchSerialization for this item."
        ) from None


def same_name_error(item_key: str, name: str, first: NestedPath, second: NestedPath) -> ValueError:
    """Two distinct paths one safetensors name would hold: the file keeps one tensor, the load gives one back."""
    return ValueError(
        f"SafetensorsSerialization: two leaves of item '{item_key}' flatten to the same key {name!r}: the paths "
        f"{first!r} and {second!r} (a file holds one tensor per dotted name, so one of them would load as the "
        f"other). Rename the dict keys so that none contains the '.' separator and no int key equals a str key "
        f"beside it, or use TorchSerialization for this item."
    )


def _storable(where: str, name: str, value: Any) -> torch.Tensor:
    """`value` as the file holds it (dense, contiguous, on the CPU), or the ValueError naming `where` and the
    fix for a leaf no safetensors file could hold and give back."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"SafetensorsSerialization only supports tensor values, but key '{where}' has type "
            f"'{type(value).__name__}'. Use TorchSerialization or JsonSerialization for non-tensor data."
        )
    if name == RESERVED_NAME:
        raise ValueError(
            f"SafetensorsSerialization cannot store key '{where}': safetensors reserves the name "
            f"{RESERVED_NAME!r} for the file's metadata, and the file would not load. Rename that dict key."
        )
    if storage_freed(local_tensor(value)):
        raise freed_refusal("SafetensorsSerialization cannot store", where, local_tensor(value))
    tensor = tensor_for_write(value)
    if not is_dense_data(tensor):  # a safetensors file holds dense tensors: a dtype, a shape and the bytes
        raise ValueError(
            f"SafetensorsSerialization stores dense tensors only, but key '{where}' holds a {_kind(tensor)} "
            f"tensor. Use TorchSerialization for it, or convert it first (.to_dense(), .dequantize(), ...)."
        )
    if not stores_dtype(tensor.dtype):
        raise ValueError(
            f"SafetensorsSerialization cannot store key '{where}': the installed safetensors has no {tensor.dtype} "
            f"dtype that it writes and reads back. Use TorchSerialization for this item, or convert the tensor to "
            f"a dtype safetensors stores."
        )
    return tensor.contiguous().cpu()


@functools.cache
def stores_dtype(dtype: torch.dtype) -> bool:
    """Whether the installed safetensors writes `dtype` and reads it back as `dtype` from bytes (an object
    store's read), and the engine's dtype table names it for block reads: asked of the library itself, once
    per dtype. Its tables grow between releases and not in step: complex128 surfaced as a bare `KeyError`
    while writing; float8_e8m0fnu and float4_e2m1fn_x2 were written and then failed every load."""
    from safetensors.torch import load, save

    from torch_checkpointing.codecs import SAFETENSORS_DTYPES  # codecs imports this module

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that an empty complex32 tensor is "experimental"
            loaded = load(save({"probe": torch.empty(0, dtype=dtype)}))["probe"]
    except (KeyError, ValueError, TypeError, NotImplementedError):
        return False
    return loaded.dtype == dtype and dtype in SAFETENSORS_DTYPES.values()


def _kind(t: torch.Tensor) -> str:
    if t.device.type == "meta":
        return "meta"
    if t.is_quantized:
        return "quantized"
    return "nested" if t.is_nested else str(t.layout).removeprefix("torch.")


def unflatten_to_target(flat: Mapping[str, Any], target: Any) -> Any:
    """Re-nest `flat` following `target`'s structure, so the merge sees what a Torch file of the same value
    would give it.

    Dict parents keep only the leaves found (the merge then reports the rest missing); list/tuple parents
    get `MISSING` placeholders, which the merge turns into None and reports. Leaves the file holds and the
    template lacks are kept, so the merge returns them and reports them unexpected: nested under their dotted
    name where the parents are dicts, appended where a list runs on past the template's end, else under the
    full dotted name at the top. Where the file holds a container and the template a leaf, or the other way
    round, the file's side is given as it is, so the merge refuses it naming the path (it came back as None
    or as the template's own value, the file's tensors dropped, before).
    """
    tree = _FlatTree(flat)
    out = tree.unflatten(target, "")
    extras = [k for k in flat if k not in tree.used]
    if extras and isinstance(out, dict):
        for name in extras:
            _insert(out, name, flat[name])
    return out


def unflatten_for_caller(flat: Mapping[str, Any], target: Any) -> Any:
    """`unflatten_to_target` as API_SURFACE §4 states it for callers of the public helper: a missing leaf of a
    list/tuple parent (or a missing leaf template at the top) is None, not the engine's internal `MISSING`
    placeholder (which only the merge may see, to report it), and a list/tuple parent comes back as
    `type(template)(...)` (a named tuple by its fields, when the file holds as many entries)."""
    return _settle(unflatten_to_target(flat, target), target)


def _settle(value: Any, target: Any) -> Any:
    if value is MISSING:
        return None
    if isinstance(target, Mapping) and isinstance(value, dict):
        return {k: _settle(v, target[k]) if k in target else v for k, v in value.items()}
    if is_sequence(target) and isinstance(value, list):
        items = [_settle(v, target[i]) if i < len(target) else v for i, v in enumerate(value)]
        kind = type(target)
        if kind is list or kind is tuple:
            return kind(items)
        if hasattr(kind, "_fields"):  # a named tuple: built from its fields
            return kind(*items) if len(items) == len(target) else tuple(items)
        try:
            return kind(items)
        except TypeError:  # a sequence type that does not build from one iterable
            return tuple(items) if isinstance(target, tuple) else items
    return value


def _insert(out: dict[Any, Any], name: str, value: Any) -> None:
    node = out
    parts = name.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            out[name] = value
            return
        node = child
    if parts[-1] in node:
        out[name] = value
    else:
        node[parts[-1]] = value


class _FlatTree:
    """A safetensors file's `name -> tensor` map seen as a tree: which names are leaves, which are parents
    (a proper prefix of some name; the top, `""`, is every name's), and which entries a re-nest took.

    Parents are found by bisecting the sorted names, never stored: a set of every name's prefixes held
    O(L^2) characters for a name of L dots (one 98 KB name of a crafted file took gigabytes), and listing a
    subtree scanned every name once per template leaf (K leaves x N names).
    """

    def __init__(self, flat: Mapping[str, Any]) -> None:
        self.flat = flat
        self.used: set[str] = set()
        self._sorted = sorted(flat)
        self._order = {name: i for i, name in enumerate(flat)}

    def _is_parent(self, prefix: str) -> bool:
        if not prefix:
            return bool(self._sorted) and self._sorted[-1] != ""
        start = prefix + "."
        at = bisect.bisect_left(self._sorted, start)
        return at < len(self._sorted) and self._sorted[at].startswith(start)

    def _names_under(self, prefix: str) -> list[str]:
        """The names strictly below `prefix`, in the file's order."""
        start = f"{prefix}." if prefix else ""
        names = self._sorted
        at = bisect.bisect_left(names, start)
        end = at
        while end < len(names) and names[end].startswith(start):
            end += 1
        return sorted((name for name in names[at:end] if name != prefix), key=self._order.__getitem__)

    def unflatten(self, target: Any, prefix: str) -> Any:
        if isinstance(target, Mapping) or is_sequence(target):
            if prefix in self.flat and not self._is_parent(prefix):
                return self._take(prefix)  # a leaf where the template has a container: the merge refuses it
            if isinstance(target, Mapping):
                return self._mapping(target, prefix)
            return self._sequence(target, prefix)
        if prefix in self.flat:
            return self._take(prefix)
        return self._subtree(prefix) if self._is_parent(prefix) else MISSING

    def _mapping(self, target: Mapping[Any, Any], prefix: str) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for k, t in target.items():
            v = self.unflatten(t, join_key(prefix, k))
            if v is not MISSING:
                out[k] = v
        return out

    def _sequence(self, target: Any, prefix: str) -> list[Any]:
        out = [self.unflatten(t, join_key(prefix, i)) for i, t in enumerate(target)]
        while (name := join_key(prefix, len(out))) in self.flat or self._is_parent(name):
            out.append(self._take(name) if name in self.flat else self._subtree(name))
        return out

    def _take(self, name: str) -> Any:
        if name in self.used:  # {"a": {"b": t}} and {"a.b": t} are one file entry: which one was saved is unknown
            raise TemplateMismatchError(
                f"Two paths of the template flatten to the same safetensors name {name!r} (a dict key with a '.' "
                f"beside a nested dict or list): the file holds one tensor for it, and which path it was saved "
                f"under is unknown. Keep one of them in the template."
            )
        self.used.add(name)
        return self.flat[name]

    def _subtree(self, prefix: str) -> dict[Any, Any]:
        """The entries under `prefix`, nested by their dotted names (a template leaf stands there)."""
        out: dict[Any, Any] = {}
        start = f"{prefix}." if prefix else ""
        for name in self._names_under(prefix):
            if name not in self.used:
                _insert(out, name[len(start) :], self._take(name))
        return out
