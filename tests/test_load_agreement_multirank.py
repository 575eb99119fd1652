"""A multi-rank load goes on on every rank or on none (real gloo ranks, one launch for every check).

Without the agreement, a damaged file that only rank 1 reads made rank 1 raise while rank 0 restored the
checkpoint: a job falling back to an earlier checkpoint on error then resumed rank 0 from step 2 and rank 1
from step 1, silently. Ranks loading different ids (a `latest_checkpoint()` that changed between ranks) went
unnoticed the same way.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.test_verified_loads_multirank import _flip
from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank


def _manager(timeout_s: float | None = None, collective: bool = True) -> CheckpointManager:
    save = CheckpointManager.Config.with_sync_save().save
    if timeout_s is not None:
        save.wait_timeout_secs = timeout_s
    config = CheckpointManager.Config(save=save, storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    config.load.collective = collective
    return CheckpointManager(config)


def _value(step: int) -> torch.Tensor:
    return torch.full((64,), float(100 * step + dist.get_rank()))


def _outcome(manager: CheckpointManager, checkpoint_id: str) -> dict[str, Any]:
    """What one load did on this rank: 'ok' or the error's type and message, and whether the template changed."""
    template = {"w": torch.full((64,), -1.0)}
    try:
        manager.load(checkpoint_id, into={"model": template})
        return {"result": "ok", "w": template["w"][0].item()}
    except CheckpointError as exc:
        return {"result": type(exc).__name__, "message": str(exc), "untouched": bool((template["w"] == -1).all())}


def scenarios(root: str) -> dict[str, Any]:
    rank, base = dist.get_rank(), Path(root)
    manager = _manager()
    try:
        for step in (1, 2):
            manager.save(str(base / f"step{step}"), {"model": {"w": _value(step)}})
        manager.save(str(base / "other"), {"model": {"w": _value(3)}})
        dist.barrier()
        if rank == 0:  # only rank 1 reads model_1.pt (same world size: the direct path)
            _flip(base / "step2" / "model_1.pt", torch.full((64,), 201.0).numpy().tobytes())
        dist.barrier()
        out: dict[str, Any] = {"damaged": _outcome(manager, str(base / "step2"))}
        resumed = None
        for step in (2, 1):  # the resume loop of a job: newest first, fall back on error
            if _outcome(manager, str(base / f"step{step}"))["result"] == "ok":
                resumed = step
                break
        out["resumed_from"] = resumed
        out["different_ids"] = _outcome(manager, str(base / ("step1" if rank == 0 else "other")))
        out["afterwards"] = _outcome(manager, str(base / "step1"))
        out["different_commits"] = _different_commits(manager, base, rank)
    finally:
        manager.close()
    for name, collective in (("alone", True), ("alone_not_collective", False)):
        alone = _manager(timeout_s=5, collective=collective)  # rank 0 loads, rank 1 never does
        try:
            out[name] = _outcome(alone, str(base / "step1")) if rank == 0 else None
            dist.barrier()
        finally:
            alone.close()
    return out


def _different_commits(manager: CheckpointManager, base: Path, rank: int) -> dict[str, Any]:
    """One id that names two commits, one per rank: rank 0 finds step1 at `ck`, rank 1 finds `other` there, as
    ranks opening an id one by one find it when a save replaces it in between (here: relative ids in two
    working directories, so it happens every time)."""
    here = base / f"view{rank}"
    shutil.copytree(base / ("step1" if rank == 0 else "other"), here / "ck")
    before = os.getcwd()
    os.chdir(here)
    try:
        return _outcome(manager, "ck")
    finally:
        os.chdir(before)


def test_a_load_goes_on_on_every_rank_or_on_none(tmp_path: Path) -> None:
    reports = launch(scenarios, 2, args=(str(tmp_path),), timeout=180)
    for rank, report in enumerate(reports):
        damaged = report["damaged"]
        assert damaged["result"] == "CorruptCheckpointError", (rank, damaged)
        assert "model_1.pt" in damaged["message"] and damaged["untouched"], (rank, damaged)
        assert report["resumed_from"] == 1, (rank, report)  # every rank falls back together
        different = report["different_ids"]
        assert different["result"] == "CheckpointError" and different["untouched"], (rank, different)
        assert "step1" in different["message"] and "other" in different["message"], (rank, different)
        assert report["afterwards"] == {"result": "ok", "w": 100.0 + rank}, (rank, report)
        mixed = report["different_commits"]  # before: rank 0 restored step 1 and rank 1 step 3, silently
        assert mixed["result"] == "CheckpointError" and mixed["untouched"], (rank, mixed)
        assert "different commits" in mixed["message"] and "load again" in mixed["message"], (rank, mixed)
    alone = reports[0]["alone"]
    assert alone["result"] == "CheckpointError" and alone["untouched"], alone
    assert "rank 1: went silent" in alone["message"], alone  # bounded by wait_timeout_secs; the silent rank named
    assert reports[0]["alone_not_collective"] == {"result": "ok", "w": 100.0}  # collective=False: rank 0 alone
