"""Resharding across real gloo ranks: live DTensors saved by N ranks, loaded onto a different M-rank mesh.

The ground truth on the loading side is torch's own `distribute_tensor` of the same full tensor.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from simulator.launcher import launch
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing import dtensor_resharder as dr
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.distributed_metadata import (
    METADATA_FILE_NAME,
    build_distributed_metadata,
    load_distributed_metadata,
)
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.source_reader import dotted_key
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank

# name -> (mesh shape, placements per layout name)
LAYOUTS: dict[str, tuple[tuple[int, ...], list[Any]]] = {
    "dp2": ((2,), [Shard(0)]),
    "dp3_cols": ((3,), [Shard(1)]),
    "fsdp_tp_2x2": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    "tp2_rep": ((2,), [Replicate()]),
    "dp2_cols": ((2,), [Shard(1)]),
}


def full_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(9, 5, generator=gen),  # uneven on 2, 3 and 4 ranks
        "emb": torch.randn(6, 4, generator=gen).to(torch.bfloat16),
        "exp_avg": torch.randn(9, 5, generator=gen),
        "exp_avg_sq": torch.randn(9, 5, generator=gen).abs(),
    }


def make_dtensor(full: torch.Tensor, layout: str) -> DTensor:
    mesh_shape, placements = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", mesh_shape)
    if any(isinstance(p, _StridedShard) for p in placements):
        # distribute_tensor does not take _StridedShard everywhere; build the local shard as torch splits it.
        local = full
        coord = mesh.get_coordinate()
        assert coord is not None
        for mesh_dim, p in enumerate(placements):
            shards, _ = p._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)
            local = shards[coord[mesh_dim]]
        return DTensor.from_local(
            local.contiguous().clone(), mesh, placements, shape=full.shape, stride=full.stride(), run_check=False
        )
    return distribute_tensor(full, mesh, placements)


def build_items(layout: str, zeros: bool) -> dict[str, Any]:
    full = full_state()
    if zeros:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    model = {"layer.w": make_dtensor(full["w"], layout), "emb": make_dtensor(full["emb"], layout)}
    optim = {
        "state": {
            0: {
                "exp_avg": make_dtensor(full["exp_avg"], layout),
                "exp_avg_sq": make_dtensor(full["exp_avg_sq"], layout),
                "step": torch.tensor(0.0 if zeros else 5.0),
            }
        },
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    return {"model": model, "optim": optim}


def save_rank(ckpt: str, layout: str) -> None:
    """What the manager does on save: write each item, gather metadata, rank 0 writes metadata.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    items = build_items(layout, zeros=False)
    resharder = DTensorResharder()
    root = Path(ckpt)
    model_layout = LayoutInfo(f"model/{rank}.safetensors", SafetensorsSerialization())
    layouts: dict[str, LayoutInfo | None] = {"model": model_layout, "optim": None}
    (root / "model").mkdir(parents=True, exist_ok=True)
    flat = {k: v.to_local().contiguous() for k, v in items["model"].items()}
    save_file(flat, str(root / "model" / f"{rank}.safetensors"))
    torch.save(items["optim"], root / f"optim_{rank}.pt")
    local_meta = {k: resharder.extract_sharding_metadata(k, v) for k, v in items.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local_meta)
    gathered_layouts: list[Any] = [None] * world
    dist.all_gather_object(gathered_layouts, layouts)
    if rank == 0:
        dm = build_distributed_metadata(gathered, gathered_layouts, world)
        (root / METADATA_FILE_NAME).write_text(json.dumps(dm.to_dict()))
    dist.barrier()


def load_rank(ckpt: str, layout: str) -> dict[str, Any]:
    """What the manager does on a resharding load; returns per-path mismatches against torch's ground truth."""
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=False))
    source = load_distributed_metadata(ckpt, storage)
    assert source is not None
    targets = build_items(layout, zeros=True)
    expected = build_items(layout, zeros=False)
    resharder = DTensorResharder()
    report: dict[str, Any] = {"failed": {}, "mismatch": [], "should_reshard": {}, "bytes": 0, "needed": 0}
    for attempt in range(2):  # a second load must reshard too (target metadata computed afresh)
        for key, target in targets.items():
            target_md = resharder.extract_sharding_metadata(key, target)
            report["should_reshard"][key] = resharder.should_reshard(source.metadata[key], target_md)
            report["failed"][key] = resharder.load(Path(ckpt), key, target_md, source.metadata[key], target, storage)
            stats = resharder.last_load_stats
            assert stats is not None
            if attempt == 0 and key == "model":
                report["bytes"] = stats.bytes_read
                report["needed"] = sum(v.to_local().numel() * v.to_local().element_size() for v in target.values())
    for key in targets:
        for path, want in _leaves(expected[key]):
            got = _at(targets[key], path)
            a = got.to_local() if isinstance(got, DTensor) else got
            b = want.to_local() if isinstance(want, DTensor) else want
            if not (a.dtype == b.dtype and torch.equal(a, b)):
                report["mismatch"].append(f"{key}::{dotted_key(path)}")
    return report


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, (*path, i))]
    return []


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for comp in path:
        value = value[comp]
    return value


@pytest.mark.parametrize(
    ("save_world", "save_layout", "load_world", "load_layout"),
    [(2, "dp2", 3, "dp3_cols"), (4, "fsdp_tp_2x2", 2, "dp2_cols")],
)
def test_reshard_between_world_sizes(
    tmp_path: Path, save_world: int, save_layout: str, load_world: int, load_layout: str
) -> None:
    launch(save_rank, save_world, args=(str(tmp_path), save_layout), timeout=90)
    reports = launch(load_rank, load_world, args=(str(tmp_path), load_layout), timeout=90)
    for rank, report in enumerate(reports):
        assert report["mismatch"] == [], f"rank {rank}: {report}"
        assert report["failed"] == {"model": [], "optim": []}, f"rank {rank}: {report}"
        assert report["should_reshard"] == {"model": True, "optim": True}
        # Model items are safetensors: the rank reads exactly its own share of bytes.
        assert report["bytes"] == report["needed"], f"rank {rank}: {report}"


def _manager() -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(resharder=DTensorResharder()), "optim": ItemSpec(resharder=DTensorResharder())},
            save=CheckpointManager.Config.with_sync_save().save,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def manager_save_rank(ckpt: str, layout: str) -> None:
    manager = _manager()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")  # the scalar `step` is meant
            manager.save(ckpt, build_items(layout, zeros=False))
    finally:
        manager.close()


def manager_load_rank(ckpt: str, layout: str) -> dict[str, Any]:
    """A manager's resharding load; returns the ranks each `plan_resharding` call planned for, and mismatches."""
    planned: list[int] = []
    real = dr.plan_resharding

    def counting(target: Any, source: Any, rank: int, stats: dr.PlanStats | None = None) -> Any:
        planned.append(rank)
        return real(target, source, rank, stats)

    dr.plan_resharding = counting  # this rank's own process: nothing else plans here
    targets = build_items(layout, zeros=True)
    manager = _manager()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            manager.load(ckpt, into=targets, strict=True)
    finally:
        manager.close()
        dr.plan_resharding = real
    return {"planned": planned, "mismatch": _mismatches(build_items(layout, zeros=False), targets)}


def _mismatches(expected: dict[str, Any], targets: dict[str, Any]) -> list[str]:
    out = []
    for key in targets:
        for path, want in _leaves(expected[key]):
            got = _local(_at(targets[key], path))
            if not (got.dtype == _local(want).dtype and torch.equal(got, _local(want))):
                out.append(f"{key}::{dotted_key(path)}")
    return out


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def test_a_manager_load_plans_each_item_once_on_every_rank(tmp_path: Path) -> None:
    # 2 ranks save row shards; 3 ranks load column shards: every rank reads both source files.
    launch(manager_save_rank, 2, args=(str(tmp_path), "dp2"), timeout=120)
    reports = launch(manager_load_rank, 3, args=(str(tmp_path), "dp3_cols"), timeout=120)
    for rank, report in enumerate(reports):
        assert report["mismatch"] == [], f"rank {rank}: {report}"
        assert report["planned"] == [rank, rank], f"rank {rank}: one plan per item (model, optim), {report}"
