"""Scenario 1: per-rank file layouts and the collision a layout without {rank} causes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from simulator.report import FAIL, HAZARD, PASS, CheckResult
from simulator.scenarios.common import (
    Meter,
    RankCtx,
    brief,
    closing,
    gather,
    ranks_label,
    same,
    zeros_like_tree,
)

NAME = "layouts"
SHARED_FILE = "shared.pt"


def _layouts(ctx: RankCtx) -> dict[str, Any]:
    lay = ctx.b.layout
    return {
        "model": None,
        "optim": lay.LayoutInfo("optim_{rank}.pt", lay.TorchSerialization()),
        "shard": lay.LayoutInfo("rank_{rank}/shard.pt", lay.TorchSerialization()),
        "meta": lay.LayoutInfo("meta/meta_{rank}.json", lay.JsonSerialization()),
        "weights": lay.LayoutInfo(
            "weights/rank_{rank}.safetensors", lay.SafetensorsSerialization(metadata={"producer": "simulator"})
        ),
    }


def expected_path(key: str, layout: Any, rank: int) -> str:
    """Where the design document says an item lands on a given rank."""
    return f"{key}_{rank}.pt" if layout is None else layout.file_path.replace("{rank}", str(rank))


def payload(seed: int, rank: int, world: int) -> dict[str, Any]:
    """Rank-specific values, deterministic from the seed, so any process can recompute them."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    return {
        "model": {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)},
        "optim": {"state": {0: {"exp_avg": torch.randn(4, 3, generator=gen)}}, "step": rank + 1},
        "shard": {"rows": torch.arange(rank * 5, rank * 5 + 5)},
        "meta": {"rank": rank, "world": world, "note": f"written by rank {rank}"},
        "weights": {"layer": {"w": torch.randn(2, 2, generator=gen)}, "bias": torch.randn(2, generator=gen)},
    }


def _template(value: dict[str, Any]) -> dict[str, Any]:
    into = {k: zeros_like_tree(v) for k, v in value.items()}
    into["meta"] = None  # JSON comes back as decoded data
    return into


def _manager(ctx: RankCtx) -> Any:
    layouts = _layouts(ctx)
    return ctx.manager({k: ctx.b.ItemSpec(layout=lay) for k, lay in layouts.items()})


def _read_back(ctx: RankCtx, source_world: int) -> tuple[list[str], int]:
    root = ctx.ckpt(NAME)
    expected = payload(ctx.plan.seed, ctx.rank, source_world)
    with closing(_manager(ctx)) as mgr:
        restored = mgr.load(root, into=_template(expected))
    return same(dict(restored), expected), 0


def save(ctx: RankCtx) -> list[CheckResult]:
    rows: list[CheckResult] = []
    root = ctx.ckpt(NAME)
    layouts = _layouts(ctx)
    meter = Meter()
    mine = [expected_path(k, lay, ctx.rank) for k, lay in layouts.items()]
    with closing(_manager(ctx)) as mgr:
        mgr.save(root, payload(ctx.plan.seed, ctx.rank, ctx.world))
    dist.barrier()
    notes: list[str] = []
    missing = [p for p in mine if not ctx.is_file(root, p)]
    if missing:
        notes.append(f"rank {ctx.rank} files missing after save: {missing}")
    everyone = gather(mine)
    flat = [p for paths in everyone for p in paths]
    if len(set(flat)) != len(flat):
        notes.append(f"expected per-rank paths collide: {sorted({p for p in flat if flat.count(p) > 1})}")
    if ctx.rank == 0:
        on_disk = set(ctx.all_files(root))
        extra = sorted(on_disk - set(flat))
        if extra:
            notes.append(f"engine bookkeeping files next to the items: {extra}")
        notes.append(f"rank 0 files: {mine}")
    written = ctx.file_bytes(root, mine)
    result = FAIL if missing or len(set(flat)) != len(flat) else PASS
    rows.append(
        ctx.row(NAME, "paths", result, notes=notes, written=written, seconds=meter.seconds, placements="per-rank files")
    )

    meter = Meter()
    diffs, _ = _read_back(ctx, ctx.world)
    rows.append(
        ctx.row(
            NAME,
            "read-back",
            PASS if not diffs else FAIL,
            notes=[f"rank {ctx.rank}: {d}" for d in diffs[:5]],
            read=meter.read,
            seconds=meter.seconds,
            placements="own files",
        )
    )
    if ctx.world > 1:
        rows.append(collision(ctx))
    return rows


def _refused(ctx: RankCtx, source: int, exc: Exception) -> tuple[str, list[str]]:
    """The reload row when the load raised.

    Refusing is safe on another world (a rank with no files of its own, or an engine that will not map per-rank
    files onto a different world without a resharder); on the world that saved the checkpoint it is a failure:
    an engine that cannot read back its own checkpoint in fresh processes must not pass.
    """
    what = f"{type(exc).__name__}: {brief(str(exc))}"
    if source == ctx.world:
        return FAIL, [f"rank {ctx.rank}: reloading on the {source}-rank world that saved it raised {what}"]
    if ctx.rank != 0 and ctx.rank != source:
        return PASS, []
    who = "ranks with files of their own" if ctx.rank < source else f"{ranks_label(source, ctx.world - 1)} (no files)"
    return PASS, [f"{who}: load refused — {what}"]


def load(ctx: RankCtx) -> list[CheckResult]:
    """Fresh processes on the target world: own data comes back, or the load is refused — never wrong data."""
    rows: list[CheckResult] = []
    source = ctx.plan.save_world
    meter = Meter()
    notes: list[str] = []
    try:
        diffs, _ = _read_back(ctx, source)
    except Exception as exc:
        result, notes = _refused(ctx, source, exc)
    else:
        if ctx.rank >= source:
            result = FAIL
            notes.append(f"rank {ctx.rank} has no files in a {source}-rank checkpoint yet loaded without an error")
        else:
            result = PASS if not diffs else FAIL
            notes = [f"rank {ctx.rank}: {d}" for d in diffs[:5]]
    rows.append(
        ctx.row(
            NAME,
            "reload",
            result,
            notes=notes,
            read=meter.read,
            seconds=meter.seconds,
            placements=f"{source} ranks' files → {ctx.world} ranks",
        )
    )
    if ctx.plan.save_world == 1 and ctx.world > 1:
        rows.append(collision(ctx))
    return rows


def collision(ctx: RankCtx) -> CheckResult:
    """A fixed path on several ranks: the engine must refuse it, or ranks overwrite each other."""
    root = ctx.ckpt(f"{NAME}-shared-{ctx.phase}")
    lay = ctx.b.layout
    spec = {"shared": ctx.b.ItemSpec(layout=lay.LayoutInfo(SHARED_FILE, lay.TorchSerialization()))}
    meter = Meter()
    value = {"rank": ctx.rank, "data": torch.full((4,), float(ctx.rank))}
    error = ""
    try:
        with closing(ctx.manager(spec)) as mgr:
            mgr.save(root, {"shared": value})
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    errors = gather(error)
    placements = f"'{SHARED_FILE}' on {ctx.world} ranks"
    refused = [r for r, e in enumerate(errors) if e]
    if refused:
        named = all(SHARED_FILE in errors[r] for r in refused)
        note = f"engine refused the save on ranks {refused}: {brief(errors[refused[0]])}" + (
            "" if named else " (the error does not name the colliding path)"
        )
        return ctx.row(NAME, "no-{rank}", HAZARD, notes=[note], placements=placements, seconds=meter.seconds)
    dist.barrier()
    if not ctx.is_file(root, SHARED_FILE):
        return ctx.row(
            NAME,
            "no-{rank}",
            FAIL,
            placements=placements,
            seconds=meter.seconds,
            notes=[f"save succeeded on every rank but {SHARED_FILE} is not in the checkpoint"],
        )
    with closing(ctx.manager(spec)) as mgr:
        got = mgr.load(root, into={"shared": None})["shared"]
    winner = got.get("rank") if isinstance(got, dict) else None
    others = ctx.world - 1
    note = (
        f"all {ctx.world} ranks saved into the one file {SHARED_FILE}; the checkpoint holds rank {winner}'s value only"
        + (
            ", the other rank's value is not in it"
            if others == 1
            else f", the other {others} ranks' values are not in it"
        )
    )
    return ctx.row(
        NAME,
        "no-{rank}",
        HAZARD,
        notes=[note],
        placements=placements,
        seconds=meter.seconds,
        written=ctx.size(root, SHARED_FILE) if ctx.rank == 0 else 0,
        read=meter.read,
    )
