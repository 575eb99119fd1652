"""A save that fails leaves no directory it made, on any rank (two real gloo ranks).

Only rank 0 creates the id's missing parents, in the step every rank agreed to, and records them so that a
failed save removes them (`commit.make_parents`, `commit.remove_made`). Every other rank then created them again,
unrecorded: the plan's `mkdir` of the id's parent on each rank, and the writer's creation of the temporary
directory with any parent it lacked. Where a rank's path is not rank 0's (a node-local disk, the case the commit
refuses: simulated here by a relative id and a working directory of each rank's own), or once rank 0 had removed
the parents of a save that failed, the failed save left those folders behind, empty, on that rank's disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

pytestmark = pytest.mark.multirank


def _saves_to_node_local_disks(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    disk = Path(root) / f"node{rank}"
    disk.mkdir()
    os.chdir(disk)
    out: dict[str, Any] = {"error": None}
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        try:
            manager.save("runs/a/step_1", {"model": {"w": torch.full((4,), float(rank))}})
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    out["left"] = sorted(str(p.relative_to(disk)) for p in disk.rglob("*"))
    return out


def test_a_failed_save_leaves_no_directory_it_made_on_any_rank(tmp_path: Path) -> None:
    results = launch(_saves_to_node_local_disks, 2, args=(str(tmp_path),), timeout=300)
    for rank, out in enumerate(results):
        assert out["error"] is not None and "node-local disk" in out["error"], (rank, out)
        assert out["left"] == [], (rank, out)
