"""A resharding load on real gloo ranks where one source file was truncated: every rank refuses it, and no
rank's template changed, including the ranks that never read that file (the load's agreement).

The checkpoint is saved by N ranks (DTensors, Shard(0)) and loaded by M ranks (Shard(0) on another mesh), so
target ranks read different source files: only some of them meet the damage themselves.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank

ROWS = 24
LAYOUTS = {"torch": None, "safetensors": LayoutInfo("model/{rank}.safetensors", SafetensorsSerialization())}


def _manager(fmt: str) -> CheckpointManager:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.items = {"model": ItemSpec(resharder=DTensorResharder(), layout=LAYOUTS[fmt])}
    return CheckpointManager(config)


def _dtensor(full: torch.Tensor) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(full, init_device_mesh("cpu", (dist.get_world_size(),)), [Shard(0)])


def save_rank(ckpt: str, fmt: str) -> None:
    full = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4)
    with _manager(fmt) as manager:
        manager.save(ckpt, {"model": {"w": _dtensor(full)}})


def load_rank(ckpt: str, fmt: str) -> dict[str, Any]:
    """This rank's outcome: the error's type and message, and whether its template is as it was."""
    template = {"w": _dtensor(torch.full((ROWS, 4), -1.0))}
    with _manager(fmt) as manager, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            manager.load(ckpt, into={"model": template})
            outcome: dict[str, Any] = {"result": "ok"}
        except CheckpointError as exc:
            outcome = {"result": type(exc).__name__, "message": str(exc)}
    outcome["untouched"] = bool((template["w"].to_local() == -1).all())
    return outcome


def _source_file(ckpt: Path, fmt: str, rank: int) -> Path:
    return ckpt / "model" / f"{rank}.safetensors" if fmt == "safetensors" else ckpt / f"model_{rank}.pt"


@pytest.mark.parametrize(("save_world", "load_world", "fmt"), [(2, 3, "safetensors"), (4, 8, "torch")])
def test_a_truncated_source_file_is_refused_on_every_rank_and_changes_no_template(
    tmp_path: Path, fmt: str, save_world: int, load_world: int
) -> None:
    ckpt = tmp_path / "ck"
    launch(save_rank, save_world, args=(str(ckpt), fmt), timeout=120)
    damaged = _source_file(ckpt, fmt, 0)  # rows [0, ROWS / save_world): only the first target ranks read them
    os.truncate(damaged, damaged.stat().st_size // 2)
    outcomes = launch(load_rank, load_world, args=(str(ckpt), fmt), timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert outcome["result"] != "ok", f"rank {rank} restored a checkpoint that other ranks refused: {outcome}"
        assert outcome["untouched"], f"rank {rank}'s template changed: {outcome}"
    # The ranks that read the file name it; the others say which ranks refused.
    assert any(damaged.name in o["message"] for o in outcomes), outcomes
