"""Loads from a store with no local paths (an object store's shape): bounded manifest reads, and files that
vanish between a load's listing and its reads.

`MemoryStorage` stands in for such a store: it has no `local_path`, so the read context takes the path it takes
for S3 (sizes from the store, bytes fetched on demand, no descriptor pinning anything). The S3 attacks against a
real S3 API server are in test_s3_attacks.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import MemoryStorage, MemoryStorageConfig, MemoryStore
from tests.test_verified_loads import AlwaysReshard
from torch_checkpointing import CheckpointManager, CorruptCheckpointError, ItemSpec
from torch_checkpointing import manifest as manifest_module
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.manifest import MANIFEST_FILE_NAME, read_manifest
from torch_checkpointing.storage.base_storage import ReadArgs


def _manager(config: MemoryStorageConfig) -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config))


def _saved(config: MemoryStorageConfig, ckpt: str) -> dict[str, Any]:
    state = {"model": {"w": torch.arange(1000, dtype=torch.float32)}, "extra": {"step": 3}}
    manager = _manager(config)
    try:
        manager.save(ckpt, state)
    finally:
        manager.close()
    return state


def _reads_of(store: MemoryStore, name: str) -> list[str]:
    return [p for op, p in store.calls if op == "read" and p.endswith(name)]


def test_an_oversized_manifest_is_refused_before_a_byte_of_it_is_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    config = MemoryStorageConfig()
    _saved(config, "/ck/step1")
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 4096)
    config.store.files["/ck/step1/" + MANIFEST_FILE_NAME] = b" " * 10_000
    config.store.calls.clear()
    manager = _manager(config)
    try:
        with pytest.raises(CorruptCheckpointError, match=r"manifest\.json is 10000 bytes, larger than 4096"):
            manager.load("/ck/step1", into={"model": {"w": torch.zeros(1000)}})
        with pytest.raises(CorruptCheckpointError, match="larger than 4096"):
            read_manifest(config.create_storage(), Path("/ck/step1"))
    finally:
        manager.close()
    assert _reads_of(config.store, MANIFEST_FILE_NAME) == []  # its size came from the store; nothing was fetched


class _DeletedWhileLoading(MemoryStorage):
    """Another process deletes the checkpoint just as this load fetches its first data file."""

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> Any:
        if str(path).endswith(".pt"):
            prefix = str(Path(path).parent) + "/"
            for name in [n for n in self.store.files if n.startswith(prefix)]:
                del self.store.files[name]
        return super().stream_read(path, read_args)


class _DeletingConfig(MemoryStorageConfig):
    def create_storage(self) -> MemoryStorage:
        return _DeletedWhileLoading(self.store)


@pytest.mark.parametrize("verify", [True, False])
def test_a_file_deleted_during_the_load_is_a_checkpoint_error_naming_it(verify: bool) -> None:
    plain = MemoryStorageConfig()
    _saved(plain, "/ck/step1")
    racing = _DeletingConfig(name=plain.name)
    conf = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=racing)
    conf.load.verify_checksums = verify
    manager = CheckpointManager(conf)
    template = {"model": {"w": torch.zeros(1000)}}
    try:
        with pytest.raises(
            CorruptCheckpointError, match=r"/ck/step1/model_0\.pt .*missing.*deleted while this load ran"
        ):
            manager.load("/ck/step1", into=template)
    finally:
        manager.close()
    assert torch.equal(template["model"]["w"], torch.zeros(1000))  # nothing was restored


# ------------------------------------------------------------------ resharded safetensors read by byte ranges


def _resharding_manager(config: MemoryStorageConfig, verify: bool | None = None) -> CheckpointManager:
    conf = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)
    conf.items = {
        "model": ItemSpec(
            resharder=AlwaysReshard(), layout=LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization())
        )
    }
    conf.load.verify_checksums = verify
    return CheckpointManager(conf)


def _dtensor(mesh: Any, value: torch.Tensor) -> Any:
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(value, mesh, [Shard(0)])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bfloat16, torch.float16])
def test_every_dtype_safetensors_stores_reshards_from_a_remote_store(mesh: Any, dtype: torch.dtype) -> None:
    """complex64 ('C64') was missing from the header table: a bare KeyError on the ranged (object store) path."""
    config = MemoryStorageConfig()
    saved = torch.arange(8, dtype=torch.float32).reshape(4, 2).to(dtype)
    manager = _resharding_manager(config)
    try:
        manager.save("/ck/s", {"model": {"w": _dtensor(mesh, saved)}})
        target = _dtensor(mesh, torch.zeros(4, 2, dtype=dtype))
        manager.load("/ck/s", into={"model": {"w": target}})
    finally:
        manager.close()
    assert torch.equal(target.to_local().view(torch.uint8), saved.view(torch.uint8))


def _header_of(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


CRAFTED: dict[str, Any] = {
    "unknown dtype": lambda h: {**h, "w": {**h["w"], "dtype": "XX"}},
    "shape not a list": lambda h: {**h, "w": {**h["w"], "shape": "abc"}},
    "no data_offsets": lambda h: {**h, "w": {k: v for k, v in h["w"].items() if k != "data_offsets"}},
    "offsets past the end": lambda h: {**h, "w": {**h["w"], "data_offsets": [0, 10**12]}},
    "offsets too short for the shape": lambda h: {**h, "w": {**h["w"], "data_offsets": [0, 4]}},
    "entry not an object": lambda h: {**h, "w": 7},
    "header a list": lambda h: [1, 2],
}


@pytest.mark.parametrize("craft", sorted(CRAFTED))
def test_a_crafted_safetensors_header_is_corrupt_checkpoint_on_the_ranged_path(mesh: Any, craft: str) -> None:
    """An unverified load (verify_checksums=False) still reads only what the header can prove is in the file."""
    config = MemoryStorageConfig()
    manager = _resharding_manager(config, verify=False)
    try:
        manager.save("/ck/s", {"model": {"w": _dtensor(mesh, torch.ones(4, 2))}})
        name = "/ck/s/model_0.safetensors"
        header, data = _header_of(config.store.files[name])
        body = json.dumps(CRAFTED[craft](header)).encode()
        config.store.files[name] = struct.pack("<Q", len(body)) + body + data
        with pytest.raises(CorruptCheckpointError, match=r"model_0\.safetensors"):
            manager.load("/ck/s", into={"model": {"w": _dtensor(mesh, torch.zeros(4, 2))}})
    finally:
        manager.close()


def test_a_safetensors_header_length_past_the_file_is_refused_unread(mesh: Any) -> None:
    config = MemoryStorageConfig()
    manager = _resharding_manager(config, verify=False)
    try:
        manager.save("/ck/s", {"model": {"w": _dtensor(mesh, torch.ones(4, 2))}})
        name = "/ck/s/model_0.safetensors"
        config.store.files[name] = struct.pack("<Q", 1 << 62) + config.store.files[name][8:]
        with pytest.raises(CorruptCheckpointError, match=r"header claims \d+ bytes"):
            manager.load("/ck/s", into={"model": {"w": _dtensor(mesh, torch.zeros(4, 2))}})
    finally:
        manager.close()
