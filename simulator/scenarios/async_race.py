"""Scenario 2: an async save racing a training loop that keeps mutating state in place.

The storage is slowed so the write is still in flight while the loop runs. With
requires_copy=True the checkpoint must be the state at the moment of save(), bit
for bit; with requires_copy=False the design document warns that later in-place
mutations may be captured, and we show whether they were; lock() around an
optimizer step must keep a save from ever capturing half a step.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from simulator.report import FAIL, HAZARD, NOT_OBSERVED, PASS, CheckResult
from simulator.scenarios.common import (
    Meter,
    RankCtx,
    clone_tree,
    closing,
    file_bytes,
    gather,
    same,
    zeros_like_tree,
)

NAME = "async-race"
_WAIT_S = 90.0


def training_state(seed: int, rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed * 104729 + rank)
    model = {f"layer{i}.weight": torch.randn(256, 256, generator=gen) for i in range(4)}
    model["head.bias"] = torch.randn(256, generator=gen)
    optimizer = {
        "state": {i: {"exp_avg": torch.randn(256, 256, generator=gen), "step": torch.tensor(3.0)} for i in range(4)},
        "param_groups": [{"lr": 1e-3, "params": [0, 1, 2, 3]}],
    }
    progress = {"samples_seen": torch.arange(1024, dtype=torch.int64) + rank, "cursor": torch.tensor([17 + rank])}
    return {"model": model, "optimizer": optimizer, "progress": progress}


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    out = list(state["model"].values())
    out += [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    return out


def optimizer_step(state: dict[str, Any], pause_s: float = 0.0) -> None:
    """An in-place step touching every tensor one after the other, like optimizer.step()."""
    for t in _tensors(state):
        t.add_(1.0)
        if pause_s:
            time.sleep(pause_s)


def _specs(ctx: RankCtx) -> dict[str, Any]:
    spec = ctx.b.ItemSpec
    return {"model": spec(requires_copy=True), "optimizer": spec(requires_copy=True), "progress": spec(requires_copy=False)}


def _read(ctx: RankCtx, directory: str, like: dict[str, Any]) -> dict[str, Any]:
    with closing(ctx.manager(_specs(ctx))) as reader:
        return dict(reader.load(directory, into={k: zeros_like_tree(v) for k, v in like.items()}))


def save(ctx: RankCtx) -> list[CheckResult]:
    rows: list[CheckResult] = []
    meter = Meter()
    state = training_state(ctx.plan.seed, ctx.rank)
    first = str(ctx.path(NAME, "mutate-after-save"))
    files = [f"{k}_{ctx.rank}.pt" for k in state]
    with closing(ctx.manager(_specs(ctx), sync=False, write_delay_s=ctx.plan.write_delay_s)) as mgr:
        snapshot = clone_tree(state)
        future = mgr.save(first, state)
        # The loop goes on the instant save() returns: the dataloader cursor is bumped without
        # any protection, the optimizer step runs under lock() as the design document asks.
        state["progress"]["samples_seen"].add_(1000)
        state["progress"]["cursor"].add_(1)
        with mgr.lock():
            optimizer_step(state)
        in_flight = not future.done()
        future.result(timeout=_WAIT_S)
        write_s = meter.seconds
        rows.extend(_judge_first(ctx, first, snapshot, state, in_flight, write_s, files))
        rows.extend(_torn_step_checks(ctx, mgr, state))
    return rows


def _judge_first(ctx: RankCtx, directory: str, snapshot: dict[str, Any], live: dict[str, Any], in_flight: bool,
                 write_s: float, files: list[str]) -> list[CheckResult]:
    meter = Meter()
    got = _read(ctx, directory, snapshot)
    written = file_bytes(ctx.path(NAME, "mutate-after-save"), files)
    flight = "write still in flight after the mutation" if in_flight else "write had already finished (storage too fast?)"
    copy_diffs = same({k: got[k] for k in ("model", "optimizer")}, {k: snapshot[k] for k in ("model", "optimizer")})
    copy_notes = [f"rank {ctx.rank}: {d}" for d in copy_diffs[:3]]
    if ctx.rank == 0:
        copy_notes.append(f"model+optimizer equal the state at save() bit for bit on every rank that passed; {flight}")
    rows = [ctx.row(NAME, "requires_copy=True", PASS if not copy_diffs else FAIL, placements="async, slowed storage",
                    notes=copy_notes, written=written, read=meter.read, seconds=write_s)]
    if not same(got["progress"], snapshot["progress"]):
        result = NOT_OBSERVED
    elif not same(got["progress"], live["progress"]):
        result = HAZARD
    else:
        result = HAZARD  # a mix of old and new values: torn, still the documented race
    seen = [r for r, res in enumerate(gather(result)) if res == HAZARD]
    if seen:
        note = (f"race observed on rank(s) {seen} of {ctx.world}: the checkpoint holds the progress value mutated "
                "after save() returned, not the value at save() — the hazard the design document describes")
    else:
        note = "race not observed this run: every rank's checkpoint holds the progress value as of save()"
    rows.append(ctx.row(NAME, "requires_copy=False", HAZARD if seen else NOT_OBSERVED, placements="async, slowed storage",
                        notes=[note] if ctx.rank == 0 else [], seconds=write_s))
    return rows


def _torn_step_checks(ctx: RankCtx, mgr: Any, state: dict[str, Any]) -> list[CheckResult]:
    rows = []
    for use_lock in (True, False):
        meter = Meter()
        directory = str(ctx.path(NAME, "locked-steps" if use_lock else "unlocked-steps"))
        base = [t[0, 0].item() if t.dim() == 2 else t[0].item() for t in _tensors(state)]
        stop = threading.Event()
        trainer = threading.Thread(target=_train, args=(mgr, state, stop, use_lock), daemon=True)
        trainer.start()
        time.sleep(0.05)
        payload = {"model": state["model"], "optimizer": state["optimizer"], "progress": state["progress"]}
        future = mgr.save(directory, payload)
        future.result(timeout=_WAIT_S)
        stop.set()
        trainer.join(timeout=_WAIT_S)
        got = _read(ctx, directory, state)
        steps = sorted({round(t[0, 0].item() - b if t.dim() == 2 else t[0].item() - b) for t, b in zip(_tensors(got), base)})
        torn_ranks = [r for r, t in enumerate(gather(len(steps) > 1)) if t]
        torn = bool(torn_ranks)
        if use_lock:
            result = FAIL if torn else PASS
            note = (f"torn step despite lock() on rank(s) {torn_ranks} (rank {ctx.rank} at steps {steps})" if torn
                    else "on every rank all tensors of the checkpoint are at the same optimizer step")
            rows.append(ctx.row(NAME, "lock()", result, placements="step under lock()", seconds=meter.seconds,
                                notes=[note] if ctx.rank == 0 else []))
        else:
            result = HAZARD if torn else NOT_OBSERVED
            note = (f"without lock() a save captured half a step on rank(s) {torn_ranks} of {ctx.world}" if torn
                    else "without lock() no torn step was captured this run")
            rows.append(ctx.row(NAME, "no lock()", result, placements="step without lock()", seconds=meter.seconds,
                                notes=[note] if ctx.rank == 0 else []))
    return rows


def _train(mgr: Any, state: dict[str, Any], stop: threading.Event, use_lock: bool) -> None:
    while not stop.is_set():
        if use_lock:
            with mgr.lock():
                optimizer_step(state, pause_s=0.002)
        else:
            optimizer_step(state, pause_s=0.002)
        time.sleep(0.001)
