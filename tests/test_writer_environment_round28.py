"""A writer process started after the environment changed writes where the manager's own storage does.

The async writer builds its storage from the environment it is spawned with (AWS_ENDPOINT_URL, the credentials),
and the manager's own storage keeps what the environment said when it was built. A writer is spawned again when
one dies; before, the new one took the trainer's environment of that moment: a job that had pointed
AWS_ENDPOINT_URL elsewhere meanwhile (for another tool) had its next save sent to that other endpoint, while
its loads and `latest_checkpoint` still read the first store. Now every writer of a manager gets the store
environment the manager was built with, and a save after a change says at WARNING which variables changed.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from pathlib import Path

import pytest
import torch

from tests.memory_storage import free_port
from tests.s3_server import S3Server
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

TIMEOUT_S = 120.0


def test_a_writer_spawned_after_the_endpoint_changed_writes_to_the_managers_store(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name, value in s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = FsspecStorageConfig(url=f"s3://{bucket}")  # endpoint and keys from the environment
    with CheckpointManager(config) as manager:
        manager.save("step_1", {"model": {"w": torch.ones(4)}}).result(TIMEOUT_S)
        # Another tool of the job is pointed elsewhere (nothing listens there), and the writer dies (the OOM
        # killer): the next save goes to a new writer.
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        pid = manager.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            # Before: this failed, the new writer reaching for the new endpoint ("Could not connect ...").
            manager.save("step_2", {"model": {"w": torch.full((4,), 2.0)}}).result(TIMEOUT_S)
        loaded = manager.load("step_2", {"model": {"w": torch.zeros(4)}})
        assert loaded["model"]["w"].tolist() == [2.0] * 4
        assert manager.writer_pid not in (None, pid)
    said = [r.getMessage() for r in caplog.records if "AWS_ENDPOINT_URL" in r.getMessage()]
    assert said and "changed since this manager was built" in said[0], [r.getMessage() for r in caplog.records]
    assert s3_server.endpoint not in said[0]  # names the variables, never their values (credentials)


def test_a_local_managers_saves_say_nothing_of_store_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            manager.save(str(tmp_path / "step_1"), {"model": {"w": torch.ones(4)}}).result(TIMEOUT_S)
    assert not [r for r in caplog.records if "AWS_ENDPOINT_URL" in r.getMessage()]
