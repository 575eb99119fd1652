"""Several ranks on this one machine (gloo on loopback, the simulator's launcher): manager start-up, the first
save's time to durable against a warm one, close(), and the aggregate time to durable of all ranks saving at
once against the raw floor of writing the same total bytes from one process.

Each rank saves its own ``size / world`` bytes (files per rank, no resharder), so every world size writes
the same total. Timed saves start from a barrier; the aggregate figure is the slowest rank's time to durable.
The floor (one process writing and fsyncing the total in one file) is taken on rank 0 between two barriers,
right before each timed save, while the other ranks wait: the same minutes of a shared machine. It writes
the very tensors all ranks save (rank 0's own, and every other rank's state rebuilt from its seed once,
before the first sample), so the floor's bytes are the ranks' bytes, not a state of about the same size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
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


def floor_tensors(own: dict[str, Any], per_rank: int, world: int) -> list[torch.Tensor]:
    """What all `world` ranks save, in rank order: `own` is rank 0's state, the others are rebuilt from
    their seeds (as each rank builds its own, `per_rank` bytes)."""
    others = [tensors_of(make_state(per_rank, seed=rank)) for rank in range(1, world)]
    return tensors_of(own) + [t for tensors in others for t in tensors]


def _floor(root: Path, host: list[torch.Tensor]) -> tuple[float, int]:
    """Rank 0 writes `host` raw (+fsync) while the others wait: (seconds, bytes in the file); (0.0, 0) elsewhere."""
    t, size = 0.0, 0
    if dist.get_rank() == 0:
        path = root / "raw_floor.bin"
        t = raw_write(host, path)
        size = os.stat(path).st_size
        remove(path)
    dist.barrier()
    return t, size


def rank_run(cfg: BenchConfig, root: str, runs: int) -> dict[str, Any]:
    """One rank: construct, first save, `runs` warm saves (each after a floor sample), close."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Path(root)
    per_rank = max(MiB, cfg.size_bytes // world)
    state = make_state(per_rank, seed=rank)
    total = sum(t.numel() * t.element_size() for t in tensors_of(state)) * world
    floor = floor_tensors(state, per_rank, world) if rank == 0 else []
    import_engine()
    dist.barrier()
    t0 = now()
    mgr = make_manager(cfg)
    out: dict[str, Any] = {
        "rank": rank,
        "ctor_s": now() - t0,
        "floor_s": [],
        "floor_bytes": [],
        "durable_s": [],
        "total": total,
    }
    try:
        out["first_durable_s"] = _barrier_timed(lambda: mgr.save(str(base / "first"), state).result())
        for i in range(runs):
            floor_s, floor_bytes = _floor(base, floor)
            out["floor_s"].append(floor_s)
            out["floor_bytes"].append(floor_bytes)
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
