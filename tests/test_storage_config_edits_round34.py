"""A storage config whose `url` was edited after it was built is read as its construction would read it.

`FsspecStorageConfig.__post_init__` fills an empty `protocol` in from `url`. Round 33 made the manager (and
`create_storage()`) run that check again on a config edited since (`config.recheck`), so the protocol taken from
the first url was then read as one the user set: `cfg.url = <another store's URL>` was refused with "leave
protocol empty (it is taken from url)", which is what the user had done.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def test_a_url_edited_to_another_store_takes_its_protocol_from_the_new_url(tmp_path: Path) -> None:
    storage_config = FsspecStorageConfig(url="memory://scratch/run")
    storage_config.url = f"file://{tmp_path}/run"
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage_config)
    with CheckpointManager(config) as manager:
        manager.save("step_1", {"m": {"x": torch.ones(2)}})
        assert torch.equal(manager.load("step_1", {"m": None})["m"]["x"], torch.ones(2))
    assert storage_config.protocol == "file"
    assert (tmp_path / "run" / "step_1").is_dir()


def test_a_protocol_the_user_set_still_refuses_a_url_of_another_store(tmp_path: Path) -> None:
    storage_config = FsspecStorageConfig(url="memory://scratch/run", protocol="memory")
    storage_config.url = f"file://{tmp_path}/run"
    with pytest.raises(ConfigError, match=r"FsspecStorageConfig.protocol"):
        storage_config.create_storage()
