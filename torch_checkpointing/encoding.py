"""Encoding an item value to a file, and decoding it back, for each of the four formats.

The same functions serve the sync writer, the background writer process and the reader.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    RawSerialization,
    SafetensorsSerialization,
    SerializationFormat,
    TorchSerialization,
)
from torch_checkpointing.errors import CorruptCheckpointError, RefusedPickleError
from torch_checkpointing.json_dataclass import from_jsonable, to_jsonable
from torch_checkpointing.safetensors_tree import flatten_tensors, unflatten_to_target
from torch_checkpointing.staging import resolve_lazy_tensors
from torch_checkpointing.storage.base_storage import Storage

__all__ = ["TRUST_HINT", "decode", "encode"]

TRUST_HINT = (
    "If you trust this checkpoint, opt in to arbitrary objects with "
    "CheckpointManager.Config(load=CheckpointLoaderConfig(weights_only=False)), or allow the listed classes "
    "with torch.serialization.add_safe_globals([...])."
)


def encode(fmt: SerializationFormat, key: str, value: Any, stream: IO[bytes]) -> None:
    """Write `value` to `stream` in `fmt`; bad values raise ValueError/TypeError naming `key`."""
    if isinstance(fmt, TorchSerialization):
        torch.save(resolve_lazy_tensors(value), stream)
    elif isinstance(fmt, JsonSerialization):
        jsonable = to_jsonable(value)
        _check_json_keys(key, jsonable, ())
        try:
            text = json.dumps(jsonable, sort_keys=True, indent=4)
        except TypeError as exc:
            raise TypeError(
                f"JsonSerialization cannot encode item '{key}': {exc}. Store JSON-compatible data "
                f"(dict, list, str, int, float, bool, None, dataclasses) or use TorchSerialization."
            ) from exc
        stream.write(text.encode("utf-8"))
    elif isinstance(fmt, RawSerialization):
        if not isinstance(value, bytes):
            raise ValueError(
                f"RawSerialization requires bytes, but key '{key}' has type '{type(value).__name__}'. "
                f"Encode the value to bytes first, or use another serialization format."
            )
        stream.write(value)
    elif isinstance(fmt, SafetensorsSerialization):
        flat = flatten_tensors(value, key)
        stream.write(safetensors_save(flat, metadata=fmt.metadata))
    else:
        raise ValueError(f"Unsupported serialization format for key '{key}': {type(fmt).__name__}")


def decode(
    fmt: SerializationFormat,
    storage: Storage,
    path: Path,
    key: str,
    *,
    template: Any = None,
    map_location: Any = None,
    weights_only: bool = True,
    use_mmap: bool = True,
) -> Any:
    """Read one item file back. Safetensors values are re-nested against `template` when one is given."""
    if isinstance(fmt, TorchSerialization):
        return _decode_torch(storage, path, key, map_location, weights_only, use_mmap)
    if isinstance(fmt, JsonSerialization):
        data = _json_loads(storage.read(path), path, key)
        return data if fmt.cls is None else from_jsonable(fmt.cls, data, f"item '{key}'")
    if isinstance(fmt, RawSerialization):
        return storage.read(path)
    if isinstance(fmt, SafetensorsSerialization):
        return _decode_safetensors(storage, path, key, template, map_location)
    raise ValueError(f"Unsupported serialization format for key '{key}': {type(fmt).__name__}")


def _decode_torch(storage: Storage, path: Path, key: str, map_location: Any, weights_only: bool, use_mmap: bool) -> Any:
    local = storage.local_path(path) if use_mmap else None
    source: Any = local if local is not None else io.BytesIO(storage.read(path))
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only, mmap=local is not None)
    except pickle.UnpicklingError as exc:
        if not weights_only:
            raise
        raise RefusedPickleError(
            f"Refused to load item '{key}' from {path} with torch's safe loader (weights_only=True): {exc}\n"
            f"{TRUST_HINT}"
        ) from exc


def _decode_safetensors(storage: Storage, path: Path, key: str, template: Any, map_location: Any) -> Any:
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise ValueError(
            f"SafetensorsSerialization map_location must be a str or torch.device, got "
            f"{type(map_location).__name__} (item '{key}')."
        )
    device = str(map_location) if map_location is not None else "cpu"
    local = storage.local_path(path)
    try:
        if local is not None:
            with safe_open(local, framework="pt", device="cpu") as f:
                flat = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle)
        else:
            flat = safetensors_load(storage.read(path))
    except (SafetensorError, ValueError, OverflowError) as exc:
        raise CorruptCheckpointError(f"File {path} for item '{key}' is not a readable safetensors file: {exc}") from exc
    if device != "cpu":
        flat = {k: v.to(device) for k, v in flat.items()}
    if template is None:
        return flat
    return unflatten_to_target(flat, template)


def _json_loads(data: bytes, path: Path, key: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"File {path} for item '{key}' is not valid JSON ({type(exc).__name__}: {exc})."
        ) from None


def _check_json_keys(key: str, value: Any, path: tuple[Any, ...]) -> None:
    """JSON object keys are strings: an int key would come back as a str and silently miss its template slot."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                where = ".".join(str(c) for c in (*path, k))
                raise TypeError(
                    f"JsonSerialization cannot encode item '{key}': dict key {k!r} at '{where}' is a "
                    f"{type(k).__name__}, and JSON keys are strings (it would load back as {str(k)!r}). Use str keys, "
                    f"or TorchSerialization for dicts with non-str keys."
                )
            _check_json_keys(key, v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json_keys(key, v, (*path, i))


def flatten_keys(template: Any, prefix: str = "") -> list[str]:
    """Dotted names of every leaf position in a template (tensors or not)."""
    if isinstance(template, dict):
        return [n for k, v in template.items() for n in flatten_keys(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(template, (list, tuple)):
        return [n for i, v in enumerate(template) for n in flatten_keys(v, f"{prefix}.{i}" if prefix else str(i))]
    return [prefix]
