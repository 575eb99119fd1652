"""A subclass of FsspecStorage that overrides its reads (to count, to decrypt, to route) gets every read.

`Storage.read_sized` is `getsize`, then `read_range` of that many bytes. FsspecStorage answers it on S3 with one
GET of its own, held to one version of the object; a subclass that overrode `getsize` or `read_range` was then
bypassed for every manifest (a load's, discovery's): a store that routes or decrypts its reads loaded raw bytes.
The subclass here is a real one against the real moto server; it records what it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager
from torch_checkpointing import latest_checkpoint
from torch_checkpointing.manifest import MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

pytest.importorskip("s3fs")


class _AuditedStorage(FsspecStorage):
    """Records each size and range it serves: a store that bills, routes or decrypts reads overrides these."""

    served: list[tuple[str, str]]

    def __init__(self, config: FsspecStorageConfig) -> None:
        super().__init__(config)
        self.served = []

    def getsize(self, path: Path) -> int:
        self.served.append(("getsize", Path(path).name))
        return super().getsize(path)

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        self.served.append(("read_range", Path(path).name))
        return super().read_range(path, offset, length)


_BUILT: list[_AuditedStorage] = []  # every storage an `_AuditedConfig` built in this process, newest last


@dataclass
class _AuditedConfig(FsspecStorageConfig):
    def create_storage(self) -> _AuditedStorage:
        _BUILT.append(_AuditedStorage(self))
        return _BUILT[-1]


def _audited(config: FsspecStorageConfig) -> _AuditedConfig:
    return _AuditedConfig(url=config.url, part_size=config.part_size, storage_options=config.storage_options)


def test_a_load_reads_the_manifest_through_the_subclass_overrides(s3_server: S3Server) -> None:
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    with sync_manager(_audited(config)) as manager:
        storage = _BUILT[-1]
        loaded = manager.load("run/step_1")
    assert torch.equal(loaded["model"]["w"], state(1.0)["model"]["w"])
    manifest_reads = [call for call, name in storage.served if name == MANIFEST_FILE_NAME]
    assert manifest_reads[:2] == ["getsize", "read_range"], storage.served


def test_discovery_reads_the_manifest_through_the_subclass_overrides(s3_server: S3Server) -> None:
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    storage = _audited(config).create_storage()
    found = latest_checkpoint(f"{config.url}/run", storage)
    assert found is not None and found.name == "step_1", found
    assert ("read_range", MANIFEST_FILE_NAME) in storage.served, storage.served
