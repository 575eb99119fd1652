"""A storage config edited after it was built: read as its construction would read it where the manager is
built from it, and never reaching a manager already running.

`FsspecStorageConfig.__post_init__` fills an empty `protocol` in from `url`. Round 33 made the manager (and
`create_storage()`) run that check again on a config edited since (`config.recheck`), so the protocol taken from
the first url was then read as one the user set: `cfg.url = <another store's URL>` was refused with "leave
protocol empty (it is taken from url)", which is what the user had done.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.memory_storage import free_port
from tests.s3_server import S3Server
from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager, SyncCheckpointSaverConfig
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


def test_options_edited_on_a_running_manager_never_reach_its_restarted_writer(s3_server: S3Server) -> None:
    """A storage config's `storage_options` edited in place after the manager was built (the next job's
    endpoint, set on the same object) is not refused (a client library fills those dicts in: no change of the
    caller's can be told from its), so it must not reach the running manager. Its writer, restarted after a
    SIGKILL, was spawned from the caller's config: it wrote to the edited endpoint while the trainer read the
    first, and every later save failed ("upload of s3://.../step_2/.incomplete failed: FSTimeoutError")."""
    storage_config = s3_server.config(request_timeout_s=5)
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(wait_timeout_secs=60), storage_config=storage_config
    )
    with CheckpointManager(config) as manager:
        manager.save("step_1", {"m": {"x": torch.ones(2)}}).result(60)  # type: ignore[union-attr]
        storage_config.storage_options["endpoint_url"] = f"http://127.0.0.1:{free_port()}"  # nothing listens
        pid = manager.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        manager.save("step_2", {"m": {"x": torch.full((2,), 2.0)}}).result(60)  # type: ignore[union-attr]
        assert torch.equal(manager.load("step_2", {"m": None})["m"]["x"], torch.full((2,), 2.0))
