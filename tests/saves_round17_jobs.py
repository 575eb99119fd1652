"""Rank functions for tests/test_saves_round17_multirank.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization


def _attempt(fn: Any) -> dict[str, Any]:
    started = time.monotonic()
    try:
        fn()
        error, failures = None, []
    except Exception as exc:
        error, failures = f"{type(exc).__name__}: {exc}", sorted(getattr(exc, "failures", {}))
    return {"error": error, "failures": failures, "seconds": time.monotonic() - started}


def round17_checks(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": dist.get_rank()}
    base = Path(root)
    # A file of one rank that is the folder of another rank's file: '01' (x on rank 0) and '01/y.pt' (y on rank 1).
    items = {
        "x": ItemSpec(layout=LayoutInfo("{rank}1", TorchSerialization())),
        "y": ItemSpec(layout=LayoutInfo("0{rank}/y.pt", TorchSerialization())),
    }
    for mode in ("sync", "async"):
        config = (
            CheckpointManager.Config.with_sync_save() if mode == "sync" else CheckpointManager.Config.with_async_save()
        )
        config.items = items
        config.save.wait_timeout_secs = 30
        manager = CheckpointManager(config)

        def save(manager: CheckpointManager = manager, mode: str = mode) -> None:
            write = manager.save(str(base / f"cross_{mode}"), {"x": {"w": torch.ones(2)}, "y": {"w": torch.ones(2)}})
            if write is not None:
                write.result(60)

        out[f"cross_{mode}"] = _attempt(save)
        dist.barrier()
        out[f"cross_{mode}_left"] = sorted(os.listdir(base))
        manager.close()
        dist.barrier()
    return out
