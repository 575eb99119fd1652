"""The ranged safetensors reader (resharding loads from a store without local files: S3, fsspec) refuses every
header the safetensors library refuses (issue #10: a crafted checkpoint is refused naming the file, wherever it
is stored).

Before, `_read_safetensors_header` checked each entry alone (dtype, shape, offsets inside the data), while the
library, which reads the same file on local disk, also requires the entries to tile the data exactly and the
`__metadata__` to map strings to strings. So a source whose tensors overlap (two names over one range), leave a
gap, or stop short of the file's end was refused by a local load and loaded from S3: a resharding load from a
real S3 server returned `b` holding `a`'s values, with no error.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

from tests.s3_server import S3Server
from tests.test_verified_loads import AlwaysReshard
from torch_checkpointing import CheckpointManager, CorruptCheckpointError, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.source_reader import _read_safetensors_header
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

LAYOUT = LayoutInfo("model/{rank}.safetensors", SafetensorsSerialization())
F32 = {"dtype": "F32", "shape": [2]}


def _file(entries: dict[str, Any], body: bytes) -> bytes:
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + body


_BODY = struct.pack("<4f", 1, 2, 3, 4)
_OVERLAP = {
    "a": {**F32, "data_offsets": [0, 8]},
    "b": {**F32, "data_offsets": [0, 8]},
    "c": {**F32, "data_offsets": [8, 16]},
}
_CRAFTED = {
    "two names over one range": _file(
        _OVERLAP,
        _BODY,
    ),
    "a gap before the first tensor": _file({"a": {**F32, "data_offsets": [8, 16]}}, _BODY),
    "bytes after the last tensor": _file({"a": {**F32, "data_offsets": [0, 8]}}, _BODY),
    "a gap between two tensors": _file(
        {"a": {**F32, "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}, _BODY
    ),
    "metadata that is not strings": _file({"__metadata__": {"x": 1}, "a": {**F32, "data_offsets": [0, 8]}}, _BODY[:8]),
    "metadata that is a list": _file({"__metadata__": [1], "a": {**F32, "data_offsets": [0, 8]}}, _BODY[:8]),
}


def _library_refuses(path: Path) -> bool:
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception:  # any refusal of the library's reader
        return True
    return False


@pytest.mark.parametrize("case", sorted(_CRAFTED))
def test_the_ranged_reader_refuses_what_the_library_refuses(tmp_path: Path, case: str) -> None:
    """Defect: the ranged reader accepted each of these headers; the library (local loads) refuses them."""
    path = tmp_path / "0.safetensors"
    path.write_bytes(_CRAFTED[case])
    assert _library_refuses(path), "the case must be one the library refuses"
    with pytest.raises(CorruptCheckpointError, match=r"0\.safetensors"):
        _read_safetensors_header(LocalFileSystemStorageConfig().create_storage(), path)


def test_a_header_the_library_reads_is_read_the_same(tmp_path: Path) -> None:
    """Pins the rule's other side: tensors listed out of order, tiling the data, with string metadata, read."""
    path = tmp_path / "0.safetensors"
    entries = {"__metadata__": {"k": "v"}, "b": {**F32, "data_offsets": [8, 16]}, "a": {**F32, "data_offsets": [0, 8]}}
    path.write_bytes(_file(entries, _BODY))
    assert not _library_refuses(path)
    header, _ = _read_safetensors_header(LocalFileSystemStorageConfig().create_storage(), path)
    assert sorted(header) == ["a", "b"]


def _manager(config: FsspecStorageConfig) -> CheckpointManager:
    items = {"model": ItemSpec(resharder=AlwaysReshard(), layout=LAYOUT)}
    manager_config = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), storage_config=config)
    return CheckpointManager(manager_config)


def _overlap_b_onto_a(config: FsspecStorageConfig, ckpt: str) -> None:
    """Point `b` at `a`'s bytes (its own range left as a gap), and forge the manifest's size and CRC to match."""
    storage = config.create_storage()
    rel = Path(ckpt) / "model" / "0.safetensors"
    data = storage.read(rel)
    (n,) = struct.unpack("<Q", data[:8])
    entries = json.loads(data[8 : 8 + n])
    entries["b"]["data_offsets"] = entries["a"]["data_offsets"]
    crafted = _file(entries, data[8 + n :])
    manifest = json.loads(storage.read(Path(ckpt) / "manifest.json"))
    record = manifest["items"]["model"]["0"]
    record.update(size=len(crafted), crc32=zlib.crc32(crafted))
    record.pop("blocks", None)
    for path, new in [(rel, crafted), (Path(ckpt) / "manifest.json", json.dumps(manifest).encode())]:
        storage.delete(path)  # writes never replace an object
        storage.write(path, new)


def test_an_s3_resharding_source_with_overlapping_tensors_is_refused(s3_server: S3Server) -> None:
    """Defect: the resharding load from S3 returned `b` as `a`'s values (the local load of the same checkpoint
    is refused by the library)."""
    config = s3_server.config()
    ckpt = "run/step_1"
    with _manager(config) as m, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        m.save(ckpt, {"model": {"a": torch.arange(4.0), "b": torch.arange(4.0) + 10}})
    _overlap_b_onto_a(config, ckpt)
    template = {"a": torch.full((4,), -1.0), "b": torch.full((4,), -1.0)}
    with _manager(config) as m, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        with pytest.raises(CorruptCheckpointError, match=r"0\.safetensors"):
            m.load(ckpt, into={"model": template})
    assert all(bool((t == -1.0).all()) for t in template.values()), template
