"""Baseline: torch.distributed.checkpoint save, async_save and load on the same
state and directory (single process, no process group)."""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .common import build_state, fresh_dir, now, remove, sync
from .config import BenchConfig
from .state import make_templates, mutate, same_values, tensors_of
from .sysinfo import drop_page_cache

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    state = build_state(cfg)
    root = fresh_dir(workdir / "dcp")
    saves, blocked, durable = [], [], []
    for i in range(cfg.runs):
        path = root / f"sync_{i}"
        t0 = now()
        dcp_save(state, checkpoint_id=str(path))
        saves.append(now() - t0)
        remove(path)
    # async_save: blocked = until the call returns (it stages before returning),
    # durable = until its Future resolves (FileSystemWriter fsyncs by default).
    # One extra cold run first: DCP allocates its staging buffers then.
    for i in range(cfg.runs + 1):
        path = root / f"async_{i}"
        t0 = now()
        fut = dcp_async_save(state, checkpoint_id=str(path))
        t1 = now()
        _durable(fut)
        t2 = now()
        if i > 0:
            blocked.append(t1 - t0)
            durable.append(t2 - t0)
        else:
            cold_blocked = t1 - t0
        if i < cfg.runs:
            remove(path)
    out: dict[str, Any] = {
        "save_s": saves,
        "async_blocked_s": blocked,
        "async_durable_s": durable,
        "async_blocked_cold_s": cold_blocked,
    }
    if not cfg.saves_only:
        path = root / f"async_{cfg.runs}"
        templates = make_templates(state)
        cold, warm = [], []
        for _ in range(cfg.runs):
            drop_page_cache(path)
            t0 = now()
            dcp_load(templates, checkpoint_id=str(path))
            sync(cfg.device)
            cold.append(now() - t0)
            t0 = now()
            dcp_load(templates, checkpoint_id=str(path))
            sync(cfg.device)
            warm.append(now() - t0)
        if not same_values(templates, state):
            raise RuntimeError("dcp.load baseline loaded different values than were saved")
        out["load_cold_s"] = cold
        out["load_warm_s"] = warm
        # Does async_save really stage a copy? Mutate after a save returns; the
        # checkpoint must still hold the old values.
        snap = make_templates(state)
        for a, b in zip(tensors_of(snap), tensors_of(state), strict=True):
            a.copy_(b)
        p2 = root / "mutation_probe"
        fut = dcp_async_save(state, checkpoint_id=str(p2))
        mutate(state)
        _durable(fut)
        dcp_load(templates, checkpoint_id=str(p2))
        out["async_stages_copy"] = same_values(templates, snap)
    remove(root)
    return out


def _durable(saved: Future[Any] | AsyncSaveResponse) -> None:
    """Wait until an async_save is on disk: its Future, or (with an async stager) its upload future."""
    (saved.upload_completion if isinstance(saved, AsyncSaveResponse) else saved).result()
