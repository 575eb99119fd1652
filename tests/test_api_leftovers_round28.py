"""Round 28: public-API leftovers.

* A listing under an fsspec `file://` root named each checkpoint `file://tmp/run/step_1`: the path lost its
  leading slash (the URL names host `tmp`), so the `CheckpointInfo.path` a resume hands to `load`, the CLI or
  fsspec named another place.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, FsspecStorageConfig, latest_checkpoint, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.storage import local_path_of


def _file_url_run(tmp_path: Path) -> tuple[str, FsspecStorageConfig]:
    url = f"file://{tmp_path / 'run'}"
    config = FsspecStorageConfig(url=url)
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
        m.save(f"{url}/step_1", {"model": {"w": torch.ones(2)}})
    return url, config


def test_a_checkpoint_listed_under_a_file_url_root_keeps_its_absolute_path(tmp_path: Path) -> None:
    url, config = _file_url_run(tmp_path)
    storage = config.create_storage()
    latest = latest_checkpoint(url, storage=storage)
    assert latest is not None
    assert latest.path == f"{url}/step_1"
    assert local_path_of(latest.path) == str(tmp_path / "run" / "step_1")
    assert [c.path for c in list_checkpoints(url, storage=storage)] == [f"{url}/step_1"]


def test_a_leftover_under_a_file_url_root_is_named_by_its_absolute_path(tmp_path: Path) -> None:
    url, config = _file_url_run(tmp_path)
    (tmp_path / "run" / ".old_step_1_999999").mkdir()  # what a replace killed between its renames leaves
    leftovers = list_leftovers(url, storage=config.create_storage())
    assert [lo.path for lo in leftovers] == [f"{url}/.old_step_1_999999"]


def test_a_listing_warning_under_a_file_url_root_names_the_absolute_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, config = _file_url_run(tmp_path)
    damaged = tmp_path / "run" / "step_3"
    damaged.mkdir()
    (damaged / "manifest.json").write_bytes(b'{"kind": "torch_checkpointing.manifest", ')
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        list_checkpoints(url, storage=config.create_storage())
    skipped = [r.getMessage().split(",")[0] for r in caplog.records if r.getMessage().startswith("Skipping")]
    assert skipped == [f"Skipping {url}/step_3"]
