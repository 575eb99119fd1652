"""A `file://` id naming a host (`file://~/run`: the host `~`, `file://box/run`) is a ConfigError wherever
it is read, a protected id spelt so included.

`save("file://~/run/step_1")` raised a bare ValueError where `list_checkpoints` and `delete_checkpoint` raised a
ConfigError for the same id with the same words; and `prune(..., protect=["file://~/run/step_1"])` kept the id
as a URL, matched no listed checkpoint and deleted the one the caller meant to keep.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.home_dirs import home_and_work
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig, list_checkpoints
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy, prune, select_for_deletion

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


@pytest.mark.parametrize("protected", ["file://~/run/step_1", "file://box/run/step_1"])
def test_a_protected_id_naming_a_host_is_refused_not_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protected: str
) -> None:
    """It matched no listed checkpoint, so `prune` deleted the one the caller meant to keep."""
    home, _ = home_and_work(tmp_path, monkeypatch)
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2):
            manager.save(f"~/run/step_{step}", {"m": {"x": torch.ones(2)}}, step=step)
    policy = RetentionPolicy(keep_last=1)
    with pytest.raises(ConfigError, match="names the host"):
        select_for_deletion(list_checkpoints("~/run"), policy, protect=[protected])
    with pytest.raises(ConfigError, match="names the host"):
        prune("~/run", policy, protect=[protected])
    assert sorted(os.listdir(home / "run")) == ["step_1", "step_2"]


def test_a_policy_root_naming_a_host_is_refused_when_built() -> None:
    """Its refusal was each pass's WARNING, off the training thread, and no checkpoint was ever deleted: it is
    refused where the policy is built, as an empty root is (tests/test_retention_root_urls_round33.py)."""
    with pytest.raises(ConfigError, match="names the host"):
        RetentionPolicy(root="file://~/run", keep_last=1)
