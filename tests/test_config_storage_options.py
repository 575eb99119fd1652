"""The check for a config changed after construction leaves the contents of `storage_options` to the store.

A storage config's nested dicts go to the store's client library, and botocore fills in a `retries` dict given
in `config_kwargs` (adding `total_max_attempts`). The manager walked those dicts, took the library's addition
for the caller's change, and refused every save after the first one that reached the store, for any storage
config that hands its options to s3fs itself (the documented subclass extension point).
"""

from __future__ import annotations

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def _manager(root: str) -> tuple[CheckpointManager, FsspecStorageConfig]:
    storage = FsspecStorageConfig(url=root, storage_options={"config_kwargs": {"retries": {"max_attempts": 2}}})
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage)
    return CheckpointManager(config), storage


def test_a_client_library_filling_in_nested_options_is_no_change() -> None:
    manager, storage = _manager("memory://config-options/a")
    try:
        manager.save("step_1", {"model": {"w": torch.ones(2)}})
        storage.storage_options["config_kwargs"]["retries"]["total_max_attempts"] = 3  # what botocore does
        manager.save("step_2", {"model": {"w": torch.ones(2) * 2}})
        assert float(manager.load("step_2")["model"]["w"][0]) == 2.0
    finally:
        manager.close()


def test_replacing_the_storage_options_or_the_url_is_still_refused() -> None:
    manager, storage = _manager("memory://config-options/b")
    try:
        storage.storage_options = {"anon": True}
        with pytest.raises(ConfigError, match="storage_options"):
            manager.save("step_1", {"model": {"w": torch.ones(2)}})
        manager.config.storage_config = FsspecStorageConfig(url="memory://config-options/elsewhere")
        with pytest.raises(ConfigError, match="storage_config"):
            manager.save("step_1", {"model": {"w": torch.ones(2)}})
    finally:
        manager.close()
