"""A bad load() argument on one rank only (rank 1, not rank 0): every rank refuses the load, none hangs.

The check runs in the load's check phase, which the ranks agree on: rank 1's `ConfigTypeError` reaches rank 0
as a failed collective step, and neither rank changes its template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from simulator.launcher import launch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def bad_strict_on_rank_1(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    manager = CheckpointManager(config)
    path = str(Path(root) / "step_1")
    manager.save(path, {"model": {"w": torch.full((2,), float(rank + 1))}})
    template = {"w": torch.zeros(2)}
    strict: Any = "no" if rank == 1 else False
    out: dict[str, Any] = {"rank": rank}
    try:
        manager.load(path, {"model": template}, strict=strict)
        out["error"] = None
    except Exception as exc:  # every rank must get here
        out["error"] = (type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc))
    out["untouched"] = bool(torch.equal(template["w"], torch.zeros(2)))
    loaded = manager.load(path, {"model": template})  # the manager is still usable on every rank
    out["loaded"] = loaded["model"]["w"].tolist()
    manager.close()
    return out


def test_a_bad_argument_on_rank_1_fails_the_load_on_every_rank(tmp_path: Path) -> None:
    results = launch(bad_strict_on_rank_1, 2, args=(str(tmp_path),), timeout=180)
    rank0, rank1 = results
    assert rank1["error"] is not None and rank1["error"][0] == "ConfigTypeError", rank1
    assert "strict" in rank1["error"][2]
    assert rank0["error"] is not None, "rank 0 went on while rank 1 refused the load"
    assert "rank 1" in rank0["error"][2] or "strict" in rank0["error"][2], rank0
    assert rank0["untouched"] and rank1["untouched"]
    assert rank0["loaded"] == [1.0, 1.0] and rank1["loaded"] == [2.0, 2.0]
