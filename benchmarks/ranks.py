"""Several ranks on this one machine (gloo on loopback, the simulator's launcher): manager start-up, the first
save's time to durable against a warm one, close(), and the aggregate time to durable of all ranks saving at
once against the raw floor of writing the same total bytes from one process.

Each rank saves its own ``size / world`` bytes (files per rank, no resharder), so every world size writes
the same total. Timed saves start from a barrier; the aggregate figure is the slowest rank's time to durable.
The floor (one process writing and fsyncing the total in one file) is taken on rank 0 between two barriers,
right before each timed save, while the other ranks wait: the same minutes of a shared machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from .common import fresh_dir, now, remove
from .config import BenchConfig, MiB
from .engine_api import import_engine, make_manager
from .floors import raw_write
from .state import make_state, tensors_of

_WORLDS_FULL = (2, 4, 8)
_WORLDS_QUICK = (2, 4)


def _barrier_timed(fn: Any) -> float:
    """fn() timed on this rank, started together with every other rank."""
    dist.barrier()
    t0 = now()
    fn()
    return now() - t0


def _floor(cfg: BenchConfig, root: Path, total: int) -> float:
    """Rank 0 writes `total` bytes raw (+fsync) while the others wait; 0.0 elsewhere."""
    t = 0.0
    if dist.get_rank() == 0:
        host = tensors_of(make_state(total, seed=99))
        path = root / "raw_floor.bin"
        t = raw_write(host, path)
        remove(path)
    dist.barrier()
    return t


def rank_run(cfg: BenchConfig, root: str, runs: int) -> dict[str, Any]:
    """One rank: construct, first save, `runs` warm saves (each after a floor sample), close."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Path(root)
    state = make_state(max(MiB, cfg.size_bytes // world), seed=rank)
    total = sum(t.numel() * t.element_size() for t in tensors_of(state)) * world
    import_engine()
    dist.barrier()
    t0 = now()
    mgr = make_manager(cfg)
    out: dict[str, Any] = {"rank": rank, "ctor_s": now() - t0, "floor_s": [], "durable_s": [], "total": total}
    try:
        out["first_durable_s"] = _barrier_timed(lambda: mgr.save(str(base / "first"), state).result())
        for i in range(runs):
            out["floor_s"].append(_floor(cfg, base, total))
            path = str(base / f"warm_{i}")
            out["durable_s"].append(_barrier_timed(lambda: mgr.save(path, state).result()))  # noqa: B023 (run now)
    finally:
        dist.barrier()
        t0 = now()
        mgr.close()
        out["close_s"] = now() - t0
    return out


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    from simulator.launcher import launch

    out: dict[str, Any] = {}
    worlds = _WORLDS_QUICK if cfg.quick else _WORLDS_FULL
    runs = max(2, min(cfg.runs, 3))
    for world in worlds:
        root = fresh_dir(workdir / f"ranks_{world}")
        root.mkdir()
        out[str(world)] = launch(
            rank_run,
            world,
            args=(cfg, str(root), runs),
            timeout=cfg.section_timeout_s / len(worlds),
            name=f"bench-ranks{world}",
        )
        remove(root)
    return out
