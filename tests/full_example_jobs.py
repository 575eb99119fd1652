"""The design document's "Full CheckpointManager.Config example" on real ranks: save on N, load on M.

Module level so that spawned ranks can import it. The dataloader resharder is the document's
`MyCustomDataloaderResharder` shape: per-rank progress (samples consumed) redistributed over the new world.
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
from torch_checkpointing.distributed_metadata import DistributedItemMetadata, ShardingMetadata
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.resharding import Resharder
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.types import NestedPath

SHAPES = {"embed": (13, 6), "fc1": (6, 10), "fc2": (10, 3)}


@dataclass(frozen=True)
class ProgressShard(ShardingMetadata, type_name="TestProgressShard"):
    """Which rank of how many held this progress counter."""

    rank: int
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProgressShard:
        return cls(int(d["rank"]), int(d["world_size"]))

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None


class MyCustomDataloaderResharder(Resharder):
    """Sums the samples consumed by every source rank and deals them out over the target ranks."""

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[NestedPath, ShardingMetadata]:
        return {("consumed",): ProgressShard(dist.get_rank(), dist.get_world_size())}

    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: dict[NestedPath, ShardingMetadata],
        source_metadata: DistributedItemMetadata,
        target: Any,
        storage: Storage,
    ) -> list[NestedPath]:
        me = target_metadata[("consumed",)]
        assert isinstance(me, ProgressShard)
        total = 0
        for rank in sorted(source_metadata.get_all_ranks()):
            data = storage.read(source_metadata.get_file_path(rank, source_path, item_key))
            total += int(torch.load(io.BytesIO(data), weights_only=True)["consumed"])
        target["consumed"] = total // me.world_size + (1 if me.rank < total % me.world_size else 0)
        return [] if "epoch" not in target else [("epoch",)]


def full(name: str, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + salt)  # str hash() differs per process
    return torch.randn(SHAPES[name], generator=g)


def _state(mesh: Any, dim: int, fill: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    def dt(name: str, salt: int) -> DTensor:
        t = full(name, salt) if fill else torch.zeros(SHAPES[name])
        return distribute_tensor(t, mesh, [Shard(dim)])

    model = {name: dt(name, 0) for name in SHAPES}
    optimizer = {
        "state": {
            i: {"step": torch.tensor(7.0 if fill else 0.0), "exp_avg": dt(n, 1), "exp_avg_sq": dt(n, 2)}
            for i, n in enumerate(SHAPES)
        },
        "param_groups": [{"lr": 0.01, "params": list(range(len(SHAPES)))}],
    }
    return model, optimizer


def _manager() -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items={
                "model": ItemSpec(requires_copy=True, resharder=DTensorResharder()),
                "optimizer": ItemSpec(requires_copy=True, resharder=DTensorResharder()),
                "dataloader": ItemSpec(requires_copy=False, resharder=MyCustomDataloaderResharder()),
                # required=False: ranks that did not exist in the saving job have no copy of their own.
                "misc_state": ItemSpec(
                    requires_copy=False,
                    layout=LayoutInfo("misc_state_{rank}.json", JsonSerialization()),
                    required=False,
                ),
            },
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def consumed_on(rank: int) -> int:
    return 100 + 7 * rank


def save_job(root: str, shard_dim: int) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, optimizer = _state(mesh, shard_dim, fill=True)
    manager = _manager()
    future = manager.save(
        root,
        {
            "model": model,
            "optimizer": optimizer,
            "dataloader": {"consumed": consumed_on(rank)},
            "misc_state": {"step": 7, "rank": rank},
        },
    )
    assert future is not None
    future.result(timeout=300)
    manager.close()
    return sorted(p.name for p in Path(root).iterdir())


def load_job(root: str, shard_dim: int, saved_world: int) -> dict[str, Any]:
    """Load into templates sharded on `shard_dim`; report what matched, bit for bit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, optimizer = _state(mesh, shard_dim, fill=False)
    params = {name: t.to_local() for name, t in model.items()}  # identity must survive the load
    manager = _manager()
    restored = manager.load(
        root,
        into={
            "model": model,
            "optimizer": optimizer,
            "dataloader": {"consumed": -1},
            "misc_state": {"step": 0, "rank": -1},
        },
    )
    manager.close()
    expected_model, expected_opt = _state(mesh, shard_dim, fill=True)
    total = sum(consumed_on(r) for r in range(saved_world))
    return {
        "rank": rank,
        "model_exact": all(torch.equal(model[n].to_local(), expected_model[n].to_local()) for n in SHAPES),
        "model_in_place": all(model[n].to_local().data_ptr() == params[n].data_ptr() for n in SHAPES),
        "optimizer_exact": all(
            torch.equal(optimizer["state"][i][k].to_local(), expected_opt["state"][i][k].to_local())
            for i in range(len(SHAPES))
            for k in ("exp_avg", "exp_avg_sq")
        ),
        "step": float(restored["optimizer"]["state"][0]["step"]),
        "consumed": restored["dataloader"]["consumed"],
        "consumed_expected": total // world + (1 if rank < total % world else 0),
        "misc_state": restored.get("misc_state"),
    }


def load_then_save_job(root: str, saved_world: int, next_root: str) -> dict[str, Any]:
    out = load_job(root, 1, saved_world)
    out["saved"] = save_job(next_root, 0)
    return out
