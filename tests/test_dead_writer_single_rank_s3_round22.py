"""A single-rank async save to an object store (a real S3 server, moto on loopback) whose writer process is
SIGKILLed in the commit ends with a known outcome, as on a local disk (tests/test_dead_writer_single_rank_round22.py).

On an object store the id is the save's own prefix: the manifest is created first and the `.incomplete` marker
(the save's claim) removed last, which is the commit. Killed before the manifest, or with the manifest written
and the marker still there, the checkpoint is NOT committed: the trainer removes the manifest, the files and the
claim, and the Future says so. Killed right after the marker went, it is committed: the Future succeeds.
Before, all three ended as `WriterProcessDied` "The id holds its previous checkpoint, or this one".
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_faults import HoldingS3FileSystem
from tests.s3_server import S3Server
from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import WriterProcessDied
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

TIMEOUT_S = 120.0


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"the writer never reached {path.name}"
        time.sleep(0.02)


def _killed_at(s3_server: S3Server, tmp_path: Path, hold_on: str) -> tuple[Any, Any, str, int]:
    """An async save of a fresh id whose writer holds at `hold_on` and is SIGKILLed there: (plain storage,
    the save's outcome, the id, the killed writer's pid)."""
    config = s3_server.config()
    held, release = tmp_path / "held", tmp_path / "release"
    fs = HoldingS3FileSystem(
        **s3_server.storage_options(), held_file=str(held), release_file=str(release), hold_on=hold_on
    )
    manager_config = CheckpointManager.Config.with_async_save()
    manager_config.storage_config = FsspecStorageConfig(url=config.url, part_size=config.part_size, filesystem=fs)
    ckpt = f"run-{uuid.uuid4().hex[:6]}/step_1"
    with CheckpointManager(manager_config) as manager:
        future = manager.save(ckpt, {"model": {"w": torch.ones(8)}})
        _wait_for(held)
        pid = manager.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        release.touch()  # the trainer's own storage (the same filesystem) must not hold
        try:
            outcome: Any = future.result(TIMEOUT_S)
        except WriterProcessDied as exc:
            outcome = exc
    return config.create_storage(), outcome, ckpt, pid


@pytest.mark.parametrize("hold_on", ["manifest", "marker"])
def test_a_writer_killed_before_its_marker_went_commits_nothing_and_the_error_says_so(
    s3_server: S3Server, tmp_path: Path, hold_on: str
) -> None:
    storage, outcome, ckpt, pid = _killed_at(s3_server, tmp_path, hold_on)
    assert isinstance(outcome, WriterProcessDied), outcome
    said = str(outcome)
    assert "NOT committed" in said and ckpt in said and str(pid) in said, said
    assert outcome.outcome_unknown is False
    for name in (MANIFEST_FILE_NAME, INCOMPLETE_MARKER, "model_0.pt"):
        assert not storage.exists(Path(ckpt) / name), name  # nothing of the save is left under its prefix


def test_a_writer_killed_right_after_its_marker_went_is_a_committed_save(s3_server: S3Server, tmp_path: Path) -> None:
    storage, outcome, ckpt, _ = _killed_at(s3_server, tmp_path, "after marker")
    assert outcome is None, outcome
    assert storage.exists(Path(ckpt) / MANIFEST_FILE_NAME)
    assert not storage.exists(Path(ckpt) / INCOMPLETE_MARKER)
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = storage.config
    with CheckpointManager(config) as manager:
        loaded = manager.load(ckpt, {"model": {"w": torch.zeros(8)}})
    assert torch.equal(loaded["model"]["w"], torch.ones(8))
