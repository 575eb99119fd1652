"""The S3 claim on an id, on every rank: real gloo ranks (the simulator's launcher) against a real S3 server.

Every rank writes its files straight under the id, so every rank must find the id claimed by its own save
before its first upload, not only rank 0: a rank 1 that uploaded while another job held the id would replace
that job's files (tests/test_s3_claims.py has the single-rank cases).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.s3_server import S3Server
from tests.test_s3_attacks import _held_save, state
from tests.test_s3_claims import _assert_committed_intact, _finish
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
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
