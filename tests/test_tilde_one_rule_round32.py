"""One `~` rule for ids and roots: the home directory where the store is the local filesystem, a key elsewhere.

Before, the manager expanded a leading `~` in an id unless its storage config was an `FsspecStorageConfig`,
while the readers and retention (`discovery.user_path`) expanded it only for the local filesystem's storage. With
a custom StorageConfig building an object store, `save("~/a")` was refused as an absolute path the caller never
gave ("Checkpoint id '/home/.../a' is an absolute path ..."), while `latest_checkpoint("~", storage)` on the same
store read the key `~` as it is.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.home_dirs import home_and_work
from torch_checkpointing import CheckpointManager, latest_checkpoint
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.base_storage import Storage, StorageConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


@dataclass
class WrappedObjectStore(StorageConfig):
    """A StorageConfig of the caller's own (no FsspecStorageConfig) that builds an object store."""

    url: str
    may_be_process_local = True

    def create_storage(self) -> Storage:
        return FsspecStorageConfig(url=self.url).create_storage()


@dataclass
class WrappedLocal(StorageConfig):
    """A StorageConfig of the caller's own that builds the local filesystem's storage."""

    def create_storage(self) -> Storage:
        return LocalFileSystemStorageConfig().create_storage()


def test_a_custom_object_store_config_reads_tilde_as_a_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config = WrappedObjectStore(url=f"memory://bucket-{uuid.uuid4().hex}/root")
    manager_config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)
    with CheckpointManager(manager_config) as manager:
        manager.save("~/a", {"m": {"x": torch.ones(2)}})
        loaded = manager.load("~/a", into={"m": {"x": torch.zeros(2)}})
    assert torch.equal(loaded["m"]["x"], torch.ones(2))
    found = latest_checkpoint("~", config.create_storage())
    assert found is not None and found.path == "~/a"
    assert list(tmp_path.iterdir()) == []


def test_a_custom_local_config_reads_tilde_as_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home, work = home_and_work(tmp_path, monkeypatch)
    manager_config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=WrappedLocal())
    with CheckpointManager(manager_config) as manager:
        manager.save("~/run/step_1", {"m": {"x": torch.ones(2)}})
    assert (home / "run" / "step_1").is_dir()
    found = latest_checkpoint("~/run", WrappedLocal().create_storage())
    assert found is not None and Path(found.path).resolve() == (home / "run" / "step_1").resolve()
    assert list(work.iterdir()) == []


def test_a_custom_local_config_takes_a_file_url_id_as_its_path(tmp_path: Path) -> None:
    """A `file://` id is the local path it names where the storage is the local filesystem, as readers and
    retention read it (`retention.as_local_id`); the manager asked the config's type, and refused it for a
    config of the caller's own ("does not take it (not its scheme)")."""
    manager_config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=WrappedLocal())
    with CheckpointManager(manager_config) as manager:
        manager.save(f"file://{tmp_path}/run/step_1", {"m": {"x": torch.ones(2)}})
        loaded = manager.load(f"file://{tmp_path}/run/step_1", into={"m": {"x": torch.zeros(2)}})
    assert torch.equal(loaded["m"]["x"], torch.ones(2))
    found = latest_checkpoint(tmp_path / "run")
    assert found is not None and found.path == str(tmp_path / "run" / "step_1")
