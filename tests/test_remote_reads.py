"""Loads from a store with no local paths (an object store's shape): bounded manifest reads, and files that
vanish between a load's listing and its reads.

`MemoryStorage` stands in for such a store: it has no `local_path`, so the read context takes the path it takes
for S3 (sizes from the store, bytes fetched on demand, no descriptor pinning anything). The S3 attacks against a
real S3 API server are in test_s3_attacks.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import MemoryStorage, MemoryStorageConfig, MemoryStore
from torch_checkpointing import CheckpointManager, CorruptCheckpointError
from torch_checkpointing import manifest as manifest_module
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
