"""The S3 claim on an id, on every rank: real gloo ranks (the simulator's launcher) against a real S3 server.

Every rank writes its files straight under the id, so every rank must find the id claimed by its own save
before its first upload, not only rank 0: a rank 1 that uploaded while another job held the id would replace
that job's files (tests/test_s3_claims.py has the single-rank cases).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.s3_server import S3Server
from tests.test_s3_attacks import _held_save, state
from tests.test_s3_claims import _assert_committed_intact, _finish
from torch_checkpointing import CheckpointManager, latest_checkpoint
from torch_checkpointing.commit import Commit
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import owner_lock_path
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytestmark = pytest.mark.multirank


def two_ranks_save(config: FsspecStorageConfig, checkpoint_id: str) -> dict[str, Any]:
    rank = dist.get_rank()
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
        try:
            m.save(checkpoint_id, {"model": {"w": torch.full((1000,), 10.0 + rank)}})
        except CheckpointError as exc:
            return {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    return {"rank": rank, "error": ""}


def test_no_rank_uploads_under_an_id_another_save_holds(s3_server: S3Server, tmp_path: Path) -> None:
    config = s3_server.config()
    child = _held_save(s3_server, config, tmp_path, "run/held", "data")  # claimed, nothing uploaded yet
    try:
        reports = launch(two_ranks_save, 2, args=(config, "run/held"), timeout=240)
        for report in reports:
            assert "CommitError" in report["error"] and "run/held" in report["error"], report
        assert "another save is writing it" in reports[0]["error"], reports[0]
        assert config.create_storage().ls(Path("run/held")) == [INCOMPLETE_MARKER]  # no rank uploaded a byte
    finally:
        output = _finish(child, tmp_path / "release")
    assert "SAVED" in output, output[-3000:]
    _assert_committed_intact(config, "run/held", state(1.0))


def ranks_on_two_hosts_save(config: FsspecStorageConfig, checkpoint_id: str, lock_dir: str) -> dict[str, Any]:
    """Rank 1 plays a rank on another machine (its host name differs, so it cannot check the dead job's lock),
    and rank 0 reaches the claim a second late: rank 1 sees the dead claim first."""
    os.environ["TORCH_CHECKPOINTING_LOCK_DIR"] = lock_dir
    rank = dist.get_rank()
    if rank == 1:
        socket.gethostname = lambda: "another-node"  # type: ignore[assignment]
    else:
        begin = Commit.begin

        def late_begin(self: Commit, *args: Any) -> None:
            time.sleep(1.0)
            begin(self, *args)

        Commit.begin = late_begin  # type: ignore[method-assign]
    return two_ranks_save(config, checkpoint_id)


def test_a_dead_claim_only_one_rank_can_judge_is_taken_over_for_the_whole_save(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The killed job ran on rank 0's host: only rank 0 can see that its owner lock is free. Rank 1 used to be
    refused at once; it waits (a few seconds) for rank 0 to take the claim over for their save."""
    config = s3_server.config()
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    os.environ["TORCH_CHECKPOINTING_LOCK_DIR"] = str(lock_dir)
    try:
        Path(owner_lock_path("00dead00beef")).touch()  # the dead job's lock file, held by nobody
    finally:
        del os.environ["TORCH_CHECKPOINTING_LOCK_DIR"]
    claim = {"token": ".x.tmp-00dead00beef-3", "uid": "00dead00beef", "host": socket.gethostname(), "pid": 1}
    storage = config.create_storage()
    storage.write(Path("run/resumed") / INCOMPLETE_MARKER, json.dumps({**claim, "created": time.time()}).encode())
    reports = launch(ranks_on_two_hosts_save, 2, args=(config, "run/resumed", str(lock_dir)), timeout=240)
    assert [r["error"] for r in reports] == ["", ""], reports
    latest = latest_checkpoint(f"{config.url}/run", storage)
    assert latest is not None and latest.name == "resumed"
    assert storage.ls(Path("run/resumed")) == [MANIFEST_FILE_NAME, "model_0.pt", "model_1.pt"]
