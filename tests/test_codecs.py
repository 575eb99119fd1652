"""The codec registry: one codec per serialization format, reached by the format's type.

Each format round-trips through its codec (encode, decode, open as a resharding source) on a storage with
local paths (mmap, `safe_open`) and on one without (whole-file and byte-range reads); a format without a codec
is refused naming its type; the safetensors dtype table agrees with what safetensors itself writes.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save as safetensors_save

from tests.memory_storage import MemoryStorageConfig
from torch_checkpointing.checkpoint_layout import (
    SUPPORTED_FORMATS,
    JsonSerialization,
    RawSerialization,
    SafetensorsSerialization,
    SerializationFormat,
    TorchSerialization,
)
from torch_checkpointing.codecs import (
    CODECS,
    SAFETENSORS_DTYPES,
    DecodeOptions,
    codec_for,
    dtype_from_name,
    load_resharding_source,
    load_torch,
)
from torch_checkpointing.encoding import decode, encode
from torch_checkpointing.errors import RefusedPickleError
from torch_checkpointing.source_reader import ReadStats
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


@dataclass
class Point:
    x: int
    y: float


_TENSORS = {"a": {"b": torch.arange(6.0).reshape(2, 3)}, "c": [torch.ones(2, dtype=torch.int64)]}
_SAMPLES: list[tuple[SerializationFormat, Any]] = [
    (TorchSerialization(), {"w": torch.arange(4.0), "step": 3, "nested": [torch.zeros(2), "s"]}),
    (JsonSerialization(), {"lr": 0.1, "names": ["a", "b"], "inner": {"k": None}}),
    (JsonSerialization(cls=Point), Point(1, 2.5)),
    (RawSerialization(), b"\x00raw bytes\xff"),
    (SafetensorsSerialization(metadata={"format": "pt"}), _TENSORS),
]


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return LocalFileSystemStorageConfig().create_storage()
    return MemoryStorageConfig().create_storage()


def _write(storage: Storage, path: Path, fmt: SerializationFormat, value: Any) -> None:
    stream = io.BytesIO()
    codec_for(fmt, "item").encode(fmt, "item", value, stream)
    storage.mkdir(path.parent)
    storage.write(path, stream.getvalue())


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


def test_every_supported_format_has_exactly_one_codec() -> None:
    assert set(CODECS) == set(SUPPORTED_FORMATS)
    assert len({id(c) for c in CODECS.values()}) == len(CODECS)


@pytest.mark.parametrize(("fmt", "value"), _SAMPLES, ids=lambda x: type(x).__name__)
def test_each_format_round_trips_through_its_codec(
    storage: Storage, tmp_path: Path, fmt: SerializationFormat, value: Any
) -> None:
    path = tmp_path / "item_0.bin"
    _write(storage, path, fmt, value)
    codec = codec_for(fmt)
    template = value if isinstance(fmt, SafetensorsSerialization) else None
    got = codec.decode(fmt, storage, path, "item", DecodeOptions(template=template))
    assert _equal(value, got), (value, got)
    # the module-level entry points the writers and the loader call are the same codec
    assert _equal(got, decode(fmt, storage, path, "item", template=template))
    again = io.BytesIO()
    encode(fmt, "item", value, again)
    assert again.getvalue() == storage.read(path)


@pytest.mark.parametrize(("fmt", "value"), _SAMPLES, ids=lambda x: type(x).__name__)
def test_each_format_opens_as_a_resharding_source(
    storage: Storage, tmp_path: Path, fmt: SerializationFormat, value: Any
) -> None:
    path = tmp_path / "item_0.bin"
    _write(storage, path, fmt, value)
    stats = ReadStats()
    source = codec_for(fmt).open_source(fmt, storage, path, stats)
    if isinstance(fmt, TorchSerialization):
        assert source.keys() == ["w", "nested.0"]
        handle = source.tensor(("w",))
        assert handle is not None and handle.shape == (4,) and handle.dtype == torch.float32
        assert torch.equal(handle.read_block((1,), (2,), stats), torch.tensor([1.0, 2.0]))
    elif isinstance(fmt, SafetensorsSerialization):
        assert source.keys() == ["a.b", "c.0"]
        handle = source.tensor(("a", "b"))
        assert handle is not None and handle.shape == (2, 3) and handle.dtype == torch.float32
        assert torch.equal(handle.read_block((1, 1), (1, 2), stats), torch.tensor([[4.0, 5.0]]))
        assert source.tensor(("c", 0)) is not None and source.tensor(("missing",)) is None
    else:
        assert source.keys() == [] and source.tensor(("x",)) is None
    assert stats.blocks_read == (0 if isinstance(fmt, (JsonSerialization, RawSerialization)) else 1)


class _Custom(SerializationFormat):
    def to_dict(self) -> dict[str, Any]:
        return {"type": "_Custom"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> _Custom:
        return cls()


def test_a_format_without_a_codec_is_refused_naming_its_type(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Unsupported serialization format for key 'model': _Custom\. Use one of"):
        codec_for(_Custom(), "model")
    with pytest.raises(ValueError, match=r"for key 'model': _Custom"):
        encode(_Custom(), "model", {"w": 1}, io.BytesIO())
    storage = LocalFileSystemStorageConfig().create_storage()
    with pytest.raises(ValueError, match=r"_Custom"):
        decode(_Custom(), storage, tmp_path / "x", "model")


def test_a_subclass_of_a_format_uses_its_base_codec() -> None:
    @dataclass(frozen=True)
    class Tagged(TorchSerialization):
        tag: str = "t"

    assert codec_for(Tagged()) is CODECS[TorchSerialization]


class _Unsafe:
    """Not on torch's safe-loader allowlist."""


@pytest.mark.parametrize("use_mmap", [True, False])
def test_the_one_torch_loader_refuses_unsafe_pickles_naming_the_file(tmp_path: Path, use_mmap: bool) -> None:
    storage = LocalFileSystemStorageConfig().create_storage()
    path = tmp_path / "obj_0.pt"
    torch.save({"o": _Unsafe()}, str(path))
    refused = r"(?s)Refused to load item 'obj' from .*obj_0\.pt.*weights_only=False"
    with pytest.raises(RefusedPickleError, match=refused):
        load_torch(storage, path, "item 'obj'", DecodeOptions(use_mmap=use_mmap))
    trusting = DecodeOptions(weights_only=False, use_mmap=use_mmap)
    assert isinstance(load_torch(storage, path, "item 'obj'", trusting)["o"], _Unsafe)
    with pytest.raises(RefusedPickleError, match=r"obj_0\.pt"):
        codec_for(TorchSerialization()).open_source(TorchSerialization(), storage, path, ReadStats())
    with pytest.raises(RefusedPickleError, match=r"(?s)a resharding source from .*obj_0\.pt.*Keep resharded items"):
        load_resharding_source(storage, path, str(path))


@pytest.mark.parametrize("dtype", sorted(set(SAFETENSORS_DTYPES.values()), key=str))
def test_the_dtype_table_matches_what_safetensors_writes(dtype: torch.dtype) -> None:
    data = safetensors_save({"x": torch.zeros(2, dtype=dtype)})
    (n,) = struct.unpack("<Q", data[:8])
    written = json.loads(data[8 : 8 + n])["x"]["dtype"]
    assert SAFETENSORS_DTYPES[written] == dtype


def test_dtype_from_name_reads_str_of_a_dtype() -> None:
    for dtype in SAFETENSORS_DTYPES.values():
        assert dtype_from_name(str(dtype)) == dtype
    assert dtype_from_name("bfloat16") == torch.bfloat16
    assert dtype_from_name("torch.float") == torch.float32
    assert dtype_from_name("not_a_dtype") is None and dtype_from_name("Tensor") is None
