"""Rank functions for test_local_saves_round18 (module level, so spawned ranks and writers can import them)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization


def refuse_on_rank_1(checkpoint_id: str, _: Any) -> None:
    """A pre_finalize_callback that fails the save on rank 1 only (it runs in that rank's writer)."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError(f"rank 1 refuses {checkpoint_id}")


def failed_save_into_new_parents(root: str) -> dict[str, Any]:
    """Each mode: a save into `<root>/<mode>/a/b/step_1` that rank 1 fails; then what is left under `<root>`."""
    out: dict[str, Any] = {"rank": dist.get_rank()}
    items = {"model": ItemSpec(layout=LayoutInfo("rank_{rank}/model.pt", TorchSerialization()))}
    for mode in ("sync", "async"):
        make = CheckpointManager.Config.with_sync_save if mode == "sync" else CheckpointManager.Config.with_async_save
        config = make()
        config.items, config.pre_finalize_callback = items, refuse_on_rank_1
        with CheckpointManager(config) as manager:
            try:
                write = manager.save(os.path.join(root, mode, "a", "b", "step_1"), {"model": torch.ones(4)})
                if write is not None:
                    write.result(120)
                out[mode] = "saved"
            except Exception as exc:
                out[mode] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
        out[f"{mode}_left"] = sorted(
            os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files
        )
        dist.barrier()
    return out
