"""Scenario 2: an async save racing a training loop that keeps mutating state in place.

Nothing here depends on luck. The storage is slowed so the write is still in flight while the loop runs.

* requires_copy=True: the checkpoint must be the state at the moment of save(), bit for bit.
* requires_copy=False: the design document allows a later in-place mutation to reach the checkpoint, without
  requiring it. A :class:`ReadProbe` sits first inside the value; when the engine reads (pickles) the value it
  reports whether save() had already returned, and if so holds that reader until the loop has mutated the
  value. So the run shows exactly one of two things: the engine reads such values after save() returns (the
  race, demonstrated every time), or it reads them before (it cannot exhibit the race).
* lock(): an optimizer step is paused halfway when the save is taken. Under lock() the save must wait for the
  whole step; without lock() the checkpoint holds half a step (demonstrated every time).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from simulator.report import FAIL, HAZARD, PASS, CheckResult
from simulator.scenarios.common import (
    Meter,
    RankCtx,
    clone_tree,
    closing,
    gather,
    same,
    zeros_like_tree,
)

NAME = "async-race"
_WAIT_S = 90.0
_PROBE_HOLD_S = 10.0
_PROBE_KEY = "read_probe"


class ReadProbe:
    """Placed first in a requires_copy=False value: tells when and where the engine reads it, and can hold it.

    Pickling (and deep-copying) a dict visits its entries in order, so this object's ``__reduce__`` runs just
    before the engine reads the tensors after it. A read on the thread that called save() happens inside
    save(): nothing later can reach the checkpoint. A read on another thread may overlap the training loop, so
    the probe holds that reader until the loop says it has mutated the value (bounded: if save() itself waits
    for that reader, the hold ends and the probe records that save() waited). The race the design document
    allows is then either shown on every run or shown to be impossible — never left to timing. The probe
    pickles as a plain string, so the writer process never needs this class.
    """

    def __init__(self) -> None:
        self.caller = threading.get_ident()
        self.mutated = threading.Event()
        self.outcome = ""  # "" never read; "in save()"; "after save()"; "save() waited"
        self.reader = ""

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        on_caller = threading.get_ident() == self.caller
        # A later read off the caller's thread decides: an engine may look at a value in save() (a check of
        # what it pickles as) and serialize it for the checkpoint afterwards, and the later read is the one
        # whose bytes are written.
        if not self.outcome or (self.outcome == "in save()" and not on_caller):
            self.reader = threading.current_thread().name
            if on_caller:
                self.outcome = "in save()"
            else:
                self.outcome = "after save()" if self.mutated.wait(_PROBE_HOLD_S) else "save() waited"
        return str, (_PROBE_KEY,)


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
    return {
        "model": spec(requires_copy=True),
        "optimizer": spec(requires_copy=True),
        "progress": spec(requires_copy=False),
    }


def _without_probe(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: ({n: v for n, v in val.items() if n != _PROBE_KEY} if k == "progress" else val) for k, val in state.items()
    }


def _read(ctx: RankCtx, directory: str, like: dict[str, Any]) -> dict[str, Any]:
    """Load into fresh templates; the probe entry is left out of the template, so it is filtered away."""
    with closing(ctx.manager(_specs(ctx))) as reader:
        into = {k: zeros_like_tree(v) for k, v in _without_probe(like).items()}
        return dict(reader.load(directory, into=into))


def save(ctx: RankCtx) -> list[CheckResult]:
    rows: list[CheckResult] = []
    meter = Meter()
    state = training_state(ctx.plan.seed, ctx.rank)
    probe = ReadProbe()
    state["progress"] = {_PROBE_KEY: probe, **state["progress"]}
    first = ctx.ckpt(NAME, "mutate-after-save")
    files = [f"{k}_{ctx.rank}.pt" for k in state]
    with closing(ctx.manager(_specs(ctx), sync=False, write_delay_s=ctx.plan.write_delay_s)) as mgr:
        snapshot = clone_tree(_without_probe(state))
        future = mgr.save(first, state)
        # The loop goes on the instant save() returns: the dataloader cursor is bumped without
        # any protection, the optimizer step runs under lock() as the design document asks.
        state["progress"]["samples_seen"].add_(1000)
        state["progress"]["cursor"].add_(1)
        probe.mutated.set()
        with mgr.lock():
            optimizer_step(state)
        in_flight = not future.done()
        future.result(timeout=_WAIT_S)
        write_s = meter.seconds
        rows.extend(_judge_first(ctx, first, snapshot, _without_probe(state), in_flight, write_s, files))
        rows.append(_judge_progress(ctx, probe, _read(ctx, first, snapshot)["progress"], snapshot, write_s))
        rows.extend(_torn_step_checks(ctx, mgr, _without_probe(state)))
    return rows


def _judge_first(
    ctx: RankCtx,
    directory: str,
    snapshot: dict[str, Any],
    live: dict[str, Any],
    in_flight: bool,
    write_s: float,
    files: list[str],
) -> list[CheckResult]:
    meter = Meter()
    got = _read(ctx, directory, snapshot)
    written = ctx.file_bytes(directory, files)
    flight = (
        "write still in flight after the mutation" if in_flight else "write had already finished (storage too fast?)"
    )
    copy_diffs = same({k: got[k] for k in ("model", "optimizer")}, {k: snapshot[k] for k in ("model", "optimizer")})
    copy_notes = [f"rank {ctx.rank}: {d}" for d in copy_diffs[:3]]
    if ctx.rank == 0:
        copy_notes.append(f"model+optimizer equal the state at save() bit for bit on every rank that passed; {flight}")
    return [
        ctx.row(
            NAME,
            "requires_copy=True",
            PASS if not copy_diffs else FAIL,
            placements="async, slowed storage",
            notes=copy_notes,
            written=written,
            read=meter.read,
            seconds=write_s,
        )
    ]


def _judge_progress(
    ctx: RankCtx, probe: ReadProbe, got: dict[str, Any], snapshot: dict[str, Any], write_s: float
) -> CheckResult:
    """One of two definite outcomes, decided by when the engine read the value, never by timing luck."""
    at_save = not same(got, snapshot["progress"])
    result, note = _progress_verdict(ctx.rank, probe, at_save)
    notes = [note] if ctx.rank == 0 or result == FAIL else []
    return ctx.row(
        NAME, "requires_copy=False", result, placements="async, probe in the value", notes=notes, seconds=write_s
    )


def _progress_verdict(rank: int, probe: ReadProbe, at_save: bool) -> tuple[str, str]:
    """(result, note) from where the probe saw the read and what the checkpoint holds."""
    thread = probe.reader.rsplit("_", 1)[0]
    if probe.outcome == "after save()":
        # The reader was held until the mutation was made, so the checkpoint must hold the mutated value.
        if at_save:
            return FAIL, (
                f"rank {rank}: the engine read the value after the mutation, yet the checkpoint holds "
                "the value as of save()"
            )
        return HAZARD, (
            f"demonstrated: this engine reads requires_copy=False values on its '{thread}' thread, after save() "
            "has returned (it pickles them there for the writer process), so a mutation made before that read "
            "reaches the checkpoint — the race the design document allows. Mutate such values only after the "
            "write Future resolves, or use requires_copy=True"
        )
    if probe.outcome in ("in save()", "save() waited"):
        if not at_save:
            return FAIL, (
                f"rank {rank}: the engine read the value before save() returned, yet the checkpoint "
                "holds a later mutation"
            )
        where = "on the caller's thread" if probe.outcome == "in save()" else f"on its '{thread}' thread"
        return PASS, (
            f"not exhibited: this engine reads requires_copy=False values {where} before save() "
            "returns, so a later mutation cannot reach the checkpoint"
        )
    if at_save:
        return PASS, "the engine never pickled or copied the value; the checkpoint holds it as of save()"
    return HAZARD, "the engine read the value without pickling it, after the mutation: the race"


def _torn_step_checks(ctx: RankCtx, mgr: Any, state: dict[str, Any]) -> list[CheckResult]:
    """A save taken while an optimizer step is halfway: lock() must hold the save back until the step ends."""
    rows = []
    for use_lock in (True, False):
        meter = Meter()
        directory = ctx.ckpt(NAME, "locked-steps" if use_lock else "unlocked-steps")
        base = [t[0, 0].item() if t.dim() == 2 else t[0].item() for t in _tensors(state)]
        halfway, saved = threading.Event(), threading.Event()
        trainer = threading.Thread(target=_step_in_two_halves, args=(mgr, state, use_lock, halfway, saved), daemon=True)
        trainer.start()
        halfway.wait(_WAIT_S)
        future = mgr.save(
            directory, {"model": state["model"], "optimizer": state["optimizer"], "progress": state["progress"]}
        )
        saved.set()
        future.result(timeout=_WAIT_S)
        trainer.join(timeout=_WAIT_S)
        got = _read(ctx, directory, state)
        steps = sorted(
            {
                round(t[0, 0].item() - b if t.dim() == 2 else t[0].item() - b)
                for t, b in zip(_tensors(got), base, strict=True)
            }
        )
        torn_ranks = [r for r, t in enumerate(gather(len(steps) > 1)) if t]
        if use_lock:
            result = FAIL if torn_ranks else PASS
            note = (
                f"torn step despite lock() on rank(s) {torn_ranks} (rank {ctx.rank} at steps {steps})"
                if torn_ranks
                else "save() taken while a step was halfway under lock(): it waited, every tensor is at the "
                "same step on every rank"
            )
            rows.append(
                ctx.row(
                    NAME,
                    "lock()",
                    result,
                    placements="step under lock()",
                    seconds=meter.seconds,
                    notes=[note] if ctx.rank == 0 else [],
                )
            )
        else:
            result = HAZARD if torn_ranks else PASS
            note = (
                f"demonstrated: save() taken while a step was halfway without lock() captured half a step on "
                f"rank(s) {torn_ranks} of {ctx.world}"
                if torn_ranks
                else "save() taken while a step was halfway without lock() still captured whole steps"
            )
            rows.append(
                ctx.row(
                    NAME,
                    "no lock()",
                    result,
                    placements="step without lock()",
                    seconds=meter.seconds,
                    notes=[note] if ctx.rank == 0 else [],
                )
            )
    return rows


def _step_in_two_halves(
    mgr: Any, state: dict[str, Any], use_lock: bool, halfway: threading.Event, saved: threading.Event
) -> None:
    """Update half the tensors, let the save start, then finish the step.

    Under lock() the save cannot start until the step ends, so the pause is a short sleep (waiting for the
    save would deadlock); without lock() the pause lasts until save() has returned, so the save always sees
    the step halfway.
    """
    tensors = _tensors(state)
    half = len(tensors) // 2
    lock = mgr.lock() if use_lock else contextlib.nullcontext()
    with lock:
        for t in tensors[:half]:
            t.add_(1.0)
        halfway.set()
        if use_lock:
            time.sleep(0.2)
        else:
            saved.wait(_WAIT_S)
        for t in tensors[half:]:
            t.add_(1.0)
