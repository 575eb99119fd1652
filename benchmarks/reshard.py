"""Reshard load: 4 ranks save DTensor state sharded Shard(0); 8 ranks load it
(gloo on loopback, via the simulator's launcher). Per rank: bytes read vs bytes
needed, and time vs loading an 8-rank checkpoint of the same layout.

Loads verify checksums (the default): a resharding load checks the
checksummed blocks its byte ranges touch, so the bytes read below include
that widening (at most one block more at each end of each range), never a
whole-file check.

Bytes read per rank come from two /proc/self/io counters around the load
call, and the larger one counts:

* ``rchar`` on a warm load: every byte passed through read-family syscalls,
  page-cache hits included, so caching cannot hide an over-read; but it does
  not see memory-mapped reads at all.
* ``read_bytes`` on a cold load run by this rank alone (checkpoint evicted
  from the page cache, the other ranks waiting at a barrier): what the block
  layer fetched for this rank, mmap page faults and readahead included. Alone,
  because with concurrent loads a page that two ranks touch (readahead across
  a shard boundary) is charged to whichever faults first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .common import fresh_dir, now
from .config import BenchConfig
from .engine_api import make_manager
from .sysinfo import drop_page_cache, proc_io

_COLS = 256
_REL = (8, 1, 4, 2, 1, 6, 3, 1)
_ALIGN = 8  # rows divisible by both world sizes


def global_specs(total_bytes: int) -> list[tuple[str, int, torch.dtype]]:
    """(name, rows, dtype) of the global tensors: mixed sizes, fp32 and bf16."""
    specs = []
    scale = sum(_REL)
    for i, w in enumerate(_REL):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        rows = int(total_bytes * w / scale / (_COLS * (2 if i % 2 else 4)))
        specs.append((f"w{i}", max(_ALIGN, rows // _ALIGN * _ALIGN), dtype))
    return specs


def shard_values(rows: int, dtype: torch.dtype, rank: int, world: int, salt: int) -> torch.Tensor:
    """This rank's Shard(0) slice of a global tensor whose value is a function of
    its global position, so any reshard can be checked without the whole tensor."""
    per = rows // world
    r = torch.arange(rank * per, (rank + 1) * per, dtype=torch.int64).unsqueeze(1)
    c = torch.arange(_COLS, dtype=torch.int64).unsqueeze(0)
    return ((r * _COLS + c + salt) % 251).to(dtype)


def _model(specs: list[tuple[str, int, torch.dtype]], fill: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for i, (name, rows, dtype) in enumerate(specs):
        local = (
            shard_values(rows, dtype, rank, world, i) if fill else torch.full((rows // world, _COLS), -1, dtype=dtype)
        )
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return out


def _items() -> dict[str, Any]:
    from torch_checkpointing import ItemSpec
    from torch_checkpointing.dtensor_resharder import DTensorResharder

    return {"model": ItemSpec(resharder=DTensorResharder())}


def rank_save(cfg: BenchConfig, path: str) -> float:
    specs = global_specs(cfg.reshard_bytes)
    mgr = make_manager(cfg, items=_items(), sync_save=True)
    try:
        t0 = now()
        mgr.save(path, {"model": _model(specs, fill=True)})
        return now() - t0
    finally:
        mgr.close()


def _timed_load(
    mgr: Any, path: str, templates: dict[str, Any], cold: bool, only: int | None = None
) -> dict[str, float]:
    """One load on every rank at once, or (only=k) on rank k alone; a load on one rank alone takes a manager
    whose loads are not collective (`CheckpointLoaderConfig(collective=False)`), else it would wait for the
    other ranks' loads."""
    if cold and dist.get_rank() == 0:
        drop_page_cache(Path(path))
    dist.barrier()
    sample = {"s": 0.0, "rchar": 0, "read_bytes": 0}
    if only is None or only == dist.get_rank():
        io0 = proc_io()
        t0 = now()
        mgr.load(path, into={"model": templates})
        t = now() - t0
        io1 = proc_io()
        sample = {"s": t, "rchar": io1["rchar"] - io0["rchar"], "read_bytes": io1["read_bytes"] - io0["read_bytes"]}
    dist.barrier()
    return sample


def _check(templates: dict[str, Any], specs: list[tuple[str, int, torch.dtype]], kind: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, (name, rows, dtype) in enumerate(specs):
        want = shard_values(rows, dtype, rank, world, i)
        if not torch.equal(templates[name].to_local(), want):
            raise RuntimeError(f"{kind} load on rank {rank} put wrong values into model.{name}")
        templates[name].to_local().fill_(-1)


def rank_load(cfg: BenchConfig, src4: str, same8: str) -> dict[str, Any]:
    """Save the same-layout 8-rank checkpoint, then alternate same-layout and
    resharding loads (cold then warm each), and check every loaded value."""
    specs = global_specs(cfg.reshard_bytes)
    rank, world = dist.get_rank(), dist.get_world_size()
    mgr = make_manager(cfg, items=_items(), sync_save=True)
    alone = make_manager(cfg, items=_items(), sync_save=True, collective=False)
    out: dict[str, Any] = {"rank": rank, "needed": 0}
    try:
        mgr.save(same8, {"model": _model(specs, fill=True)})
        templates = _model(specs, fill=False)
        out["needed"] = sum(t.to_local().numel() * t.to_local().element_size() for t in templates.values())
        for kind in ("same", "reshard"):
            out[kind] = {"cold": [], "warm": []}
        for _ in range(cfg.runs):
            for kind, path in (("same", same8), ("reshard", src4)):
                out[kind]["cold"].append(_timed_load(mgr, path, templates, cold=True))
                out[kind]["warm"].append(_timed_load(mgr, path, templates, cold=False))
                _check(templates, specs, kind)
        for kind, path in (("same", same8), ("reshard", src4)):
            out[kind]["alone"] = []
            for turn in range(world):
                out[kind]["alone"].append(_timed_load(alone, path, templates, cold=True, only=turn))
            _check(templates, specs, kind)
    finally:
        alone.close()
        mgr.close()
    return out


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    from simulator.launcher import launch

    root = fresh_dir(workdir / "reshard")
    root.mkdir()
    src4, same8 = str(root / "saved_by_4"), str(root / "saved_by_8")
    budget = cfg.section_timeout_s / 2
    save_s = launch(rank_save, 4, args=(cfg, src4), timeout=budget)
    ranks = launch(rank_load, 8, args=(cfg, src4, same8), timeout=budget)
    return {
        "save4_s": save_s,
        "ranks": ranks,
        "bytes": sum(r * _COLS * (2 if d == torch.bfloat16 else 4) for _, r, d in global_specs(cfg.reshard_bytes)),
    }
