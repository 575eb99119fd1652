"""Flattening nested tensor containers to safetensors' flat `name -> tensor` map, and re-nesting on read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torch_checkpointing.staging import tensor_for_write
from torch_checkpointing.walk_utils import MISSING

__all__ = ["flatten_tensors", "unflatten_to_target"]


def _join(prefix: str, part: object) -> str:
    return f"{prefix}.{part}" if prefix else str(part)


def flatten_tensors(data: Any, item_key: str = "") -> dict[str, torch.Tensor]:
    """Dotted keys for every tensor leaf; DTensors become their local shard; every tensor contiguous."""
    flat: dict[str, torch.Tensor] = {}
    seen_storage: set[tuple[int, int]] = set()

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = tensor_for_write(value).contiguous()
            if value.device.type != "cpu":
                value = value.cpu()
            storage_id = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
            if value.numel() and storage_id in seen_storage:
                value = value.clone()  # safetensors refuses tensors that share memory (tied weights)
            seen_storage.add(storage_id)
            if prefix in flat:
                raise ValueError(
                    f"SafetensorsSerialization: two leaves of item '{item_key}' flatten to the same key "
                    f"{prefix!r}; rename the dict keys so that no key contains the '.' separator."
                )
            flat[prefix] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(_join(prefix, k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(_join(prefix, i), v)
        else:
            raise ValueError(
                f"SafetensorsSerialization only supports tensor values, but key '{_join(item_key, prefix) if prefix else item_key}' "
                f"has type '{type(value).__name__}'. Use TorchSerialization or JsonSerialization for non-tensor data."
            )

    visit("", data)
    return flat


def unflatten_to_target(flat: Mapping[str, Any], target: Any, prefix: str = "") -> Any:
    """Re-nest `flat` following `target`'s structure.

    Dict parents keep only the leaves found (the merge then reports the rest missing); list/tuple parents
    get `MISSING` placeholders, which the merge turns into None and reports.
    """
    if isinstance(target, Mapping):
        out: dict[Any, Any] = {}
        for k, t in target.items():
            v = unflatten_to_target(flat, t, _join(prefix, k))
            if v is not MISSING:
                out[k] = v
        return out
    if isinstance(target, (list, tuple)):
        return [unflatten_to_target(flat, t, _join(prefix, i)) for i, t in enumerate(target)]
    return flat.get(prefix, MISSING)
