"""Encoding an item value to a file, and decoding it back: the entry points the writers and the loader call.

Each format's codec lives in `codecs.py`; these two functions pick it by the format's type, so the sync writer,
the background writer process and the reader share one implementation per format.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from torch_checkpointing.checkpoint_layout import SerializationFormat
from torch_checkpointing.codecs import TRUST_HINT, DecodeOptions, codec_for
from torch_checkpointing.json_dataclass import RebuildGaps
from torch_checkpointing.storage.base_storage import Storage

__all__ = ["TRUST_HINT", "decode", "encode"]


def encode(fmt: SerializationFormat, key: str, value: Any, stream: IO[bytes]) -> None:
    """Write `value` to `stream` in `fmt`; bad values raise ValueError/TypeError naming `key`."""
    codec_for(fmt, key).encode(fmt, key, value, stream)


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
    gaps: RebuildGaps | None = None,
    operation: str = "load",
) -> Any:
    """Read one item file back, for `operation` (the read context's, which a damaged file's refusal names).
    Safetensors values are re-nested against `template` when one is given; where a JSON item and its declared
    dataclass disagree without failing is recorded in `gaps` when given."""
    options = DecodeOptions(template, map_location, weights_only, use_mmap, gaps, operation)
    return codec_for(fmt, key).decode(fmt, storage, path, key, options)
