"""A `file://` id naming a host (`file://~/run`: the host `~`, `file://box/run`) is a ConfigError wherever
it is read.

`save("file://~/run/step_1")` raised a bare ValueError where `list_checkpoints` and `delete_checkpoint` raised a
ConfigError for the same id with the same words.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.home_dirs import home_and_work
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig, list_checkpoints
from torch_checkpointing.errors import ConfigError

_HOSTS = ["file://~/run/step_1", "file://box/run/step_1", "local://~/run/step_1"]


@pytest.mark.parametrize("checkpoint_id", _HOSTS)
def test_save_and_load_of_a_file_url_naming_a_host_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_id: str
) -> None:
    home, work = home_and_work(tmp_path, monkeypatch)
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        with pytest.raises(ConfigError, match="names the host"):
            manager.save(checkpoint_id, {"m": {"x": torch.ones(2)}}, step=1)
        with pytest.raises(ConfigError, match="names the host"):
            manager.load(checkpoint_id, into={"m": {"x": torch.zeros(2)}})
    assert os.listdir(home) == [] and os.listdir(work) == []
    assert list_checkpoints(tmp_path) == []
