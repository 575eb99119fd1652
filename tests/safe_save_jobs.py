"""Rank functions for the safe-save multi-rank tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.distributed_metadata import ShardingMetadata
from torch_checkpointing.resharding import Resharder
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


class RankMetadata(ShardingMetadata, type_name="tests.RankMetadata"):
    """Per-rank metadata: with a `{rank}`-less layout, only rank 0 builds (and refuses) the distributed metadata."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankMetadata:
        return cls(int(d["rank"]))

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RankMetadata) and other.rank == self.rank


class PerRankResharder(Resharder):
    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[Any, ShardingMetadata]:
        return {(): RankMetadata(dist.get_rank())}

    def load(self, *args: Any, **kwargs: Any) -> list[Any]:
        raise NotImplementedError


def _sync(**kw: Any) -> CheckpointManager:
    cfg = CheckpointManager.Config.with_sync_save()
    for k, v in kw.items():
        setattr(cfg, k, v)
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    cfg.save.wait_timeout_secs = 20
    return CheckpointManager(cfg)


def _attempt(fn: Any) -> dict[str, Any]:
    started = time.monotonic()
    try:
        fn()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        failures = sorted(getattr(exc, "failures", {}))
    else:
        failures = []
    return {"error": error, "failures": failures, "seconds": time.monotonic() - started}


def safe_save_checks(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank}
    base = Path(root)
    # 1. A refusal on rank 0 only (building the metadata of one resharded item in a {rank}-less file), after the
    #    plan was agreed.
    fixed = ItemSpec(layout=LayoutInfo("model.pt", TorchSerialization()), resharder=PerRankResharder())
    manager = _sync(items={"model": fixed})
    out["rank0_refusal"] = _attempt(lambda: manager.save(str(base / "refused"), {"model": {"w": torch.ones(2)}}))
    out["rank0_refusal_exists"] = (base / "refused").exists()
    manager.close()
    dist.barrier()
    # 2. Ranks saving different ids: nothing is committed, every rank gets the same error.
    manager = _sync()
    out["ids"] = _attempt(lambda: manager.save(str(base / f"step_{10 + rank}"), {"model": {"w": torch.ones(2)}}))
    dist.barrier()
    out["ids_left"] = sorted(p.name for p in base.iterdir() if p.name.startswith(("step_", ".step_")))
    # 3. A target that is not a checkpoint (seen by rank 0's check): refused on every rank, nothing touched.
    (base / "user").mkdir(exist_ok=True)
    if rank == 0:
        (base / "user" / "train.log").write_text("mine")
    dist.barrier()
    out["user_dir"] = _attempt(lambda: manager.save(str(base / "user"), {"model": {"w": torch.ones(2)}}))
    out["user_files"] = sorted(p.name for p in (base / "user").iterdir())
    # 4. The manager still saves afterwards.
    out["after"] = _attempt(lambda: manager.save(str(base / "good"), {"model": {"w": torch.full((2,), float(rank))}}))
    manager.close()
    return out
