"""Defects found reviewing the round's change, each with the test that failed before its fix."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.probes import modules_after
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.checkpoint_saver import _DaemonWorker
from torch_checkpointing.config import SyncCheckpointSaverConfig


def test_the_comm_thread_survives_a_failing_job() -> None:
    """A job that raises outside its Future must not end the thread: every later save would never resolve."""
    worker = _DaemonWorker("test-comm")
    ran = threading.Event()

    def fail() -> None:
        raise ZeroDivisionError("a job that raised")

    worker.submit(fail)
    worker.submit(ran.set)
    try:
        assert ran.wait(10), "the job after a failing one never ran"
    finally:
        worker.stop()


def test_a_file_url_is_refused_by_an_object_store_config(tmp_path: Path) -> None:
    """file:// means a local path only for the local storage; an fsspec store must not take it as a key."""
    config = FsspecStorageConfig(url="memory://bucket/prefix")
    m = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config))
    try:
        with pytest.raises(ValueError, match="file://"):
            m.save(f"file://{tmp_path}/run", {"x": 1})
    finally:
        m.close()
    assert not config.create_storage().exists(Path("bucket/prefix") / str(tmp_path).lstrip("/") / "run")


def test_a_load_without_dtensors_does_not_import_the_dtensor_package(tmp_path: Path) -> None:
    """`torch.distributed.tensor` takes about a second to import; a checkpoint without DTensors must not pay it."""
    code = (
        "import torch\n"
        "from torch_checkpointing import CheckpointManager\n"
        "from torch_checkpointing.config import SyncCheckpointSaverConfig\n"
        "m = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))\n"
        f"m.save({str(tmp_path / 'c')!r}, {{'w': torch.ones(3)}})\n"
        f"m.load({str(tmp_path / 'c')!r}, into={{'w': torch.zeros(3)}})\n"
        "m.close()\n"
    )
    assert "torch.distributed.tensor" not in modules_after(code)
