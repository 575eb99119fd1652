"""Blocked time inside a real training loop: save(), then forward+backward of a
real model, then optimizer.step() inside lock(). Compared with the same loop
never saving, run before and after in the same process."""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from .common import fresh_dir, now, remove, sync
from .config import BenchConfig
from .engine_api import make_manager
from .floors import memcpy_floor
from .state import model_for_state_bytes, nbytes, tensors_of

_MAX_BATCH = 4096


class _Trainer:
    def __init__(self, cfg: BenchConfig) -> None:
        torch.manual_seed(cfg.seed)
        self.device = cfg.device
        self.model = model_for_state_bytes(cfg.loop_state_bytes).to(cfg.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.width = self.model.width
        self.batch = 64
        self.x = torch.randn(self.batch, self.width, device=cfg.device)

    def set_batch(self, batch: int) -> None:
        self.batch = batch
        self.x = torch.randn(batch, self.width, device=self.device)

    def forward_backward(self) -> None:
        loss = self.model(self.x).square().mean()
        loss.backward()

    def payload(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def step(self, lock: Any) -> float:
        """Optimizer step under the engine's lock; returns the wait to enter it."""
        t0 = now()
        with lock():
            waited = now() - t0
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
        sync(self.device)
        return waited


def _plain_steps(tr: _Trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = now()
        tr.forward_backward()
        tr.step(nullcontext)
        times.append(now() - t0)
    return times


def _calibrate(tr: _Trainer, copy_s: float) -> float:
    """Grow the batch until forward+backward takes >= 3x the staging copy (the
    regime the target is stated for), capped to keep the run short."""
    fb = 0.0
    for _ in range(8):
        samples = []
        for _ in range(3):
            t0 = now()
            tr.forward_backward()
            sync(tr.device)
            samples.append(now() - t0)
        fb = min(samples)
        if fb >= 3 * copy_s or tr.batch >= _MAX_BATCH:
            break
        tr.set_batch(min(_MAX_BATCH, int(tr.batch * max(2.0, 3 * copy_s / max(fb, 1e-6)))))
    tr.opt.zero_grad(set_to_none=False)
    return fb


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    # Training gets all cores but one; the other is the checkpoint writer's.
    # With every core given to intra-op threads, their spin-waits fight the
    # writer process and any other load, and step times swing by 10x or more.
    threads = max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    tr = _Trainer(cfg)
    tr.forward_backward()
    tr.step(nullcontext)  # creates the AdamW state
    state_bytes = nbytes(tr.payload())
    # min, not median: the calibration wants the copy's real cost, and on a
    # shared machine the slow samples are other processes, not the copy.
    copy_s = min(memcpy_floor(tensors_of(tr.payload()), 5, cfg.device))
    fb_s = _calibrate(tr, copy_s)
    n_plain = max(6, cfg.runs * 2)
    before = _plain_steps(tr, n_plain)
    root = fresh_dir(workdir / "loop")
    root.mkdir()
    mgr = make_manager(cfg, overlap_staging=True)  # the copy overlaps forward/backward; step() is under lock()
    steps: list[dict[str, Any]] = []
    saves = 0
    fut = None
    written: list[Path] = []
    gap, quiet = 3, 3
    deadline = now() + cfg.section_timeout_s / 2
    try:
        step = 0
        while saves < cfg.runs + 1 or (fut is not None and not fut.done()):
            t0 = now()
            called = False
            # After each save completes, `gap` steps run with nothing in flight:
            # they are the no-save baseline taken in the same time window.
            if saves < cfg.runs + 1 and (fut is None or fut.done()) and quiet >= gap:
                if fut is not None:
                    fut.result()
                if len(written) > 2:
                    remove(written.pop(0))
                written.append(root / f"step_{step}")
                fut = mgr.save(str(written[-1]), tr.payload())
                saves += 1
                called = True
            inflight = called or (fut is not None and not fut.done())
            quiet = 0 if inflight else quiet + 1
            tr.forward_backward()
            waited = tr.step(mgr.lock)
            steps.append(
                {
                    "step_s": now() - t0,
                    "lock_wait_s": waited,
                    "save_called": called,
                    "in_flight": inflight,
                    "save_index": saves,
                }
            )
            step += 1
            if now() > deadline:
                raise TimeoutError(
                    f"the loop made {step} steps in {cfg.section_timeout_s / 2:.0f}s "
                    f"without completing {cfg.runs + 1} saves ({saves} started)"
                )
        if fut is not None:
            fut.result()
    finally:
        mgr.close()
    after = _plain_steps(tr, n_plain)
    remove(root)
    warm = [s for s in steps if s["save_index"] >= 2]
    cold = [s for s in steps if s["save_index"] == 1]
    return {
        "state_bytes": state_bytes,
        "copy_s": copy_s,
        "forward_backward_s": fb_s,
        "batch": tr.batch,
        # The baseline is the quiet steps between saves (same time window as the
        # steps with a save in flight); the separate no-save loops are context.
        "plain_step_s": [s["step_s"] for s in warm if not s["in_flight"]],
        "no_save_loop_step_s": before + after,
        "save_step_s": [s["step_s"] for s in warm if s["save_called"]],
        "save_lock_wait_s": [s["lock_wait_s"] for s in warm if s["save_called"]],
        "inflight_step_s": [s["step_s"] for s in warm if s["in_flight"]],
        "inflight_lock_wait_s": [s["lock_wait_s"] for s in warm if s["in_flight"]],
        "cold_save_step_s": [s["step_s"] for s in cold if s["save_called"]],
        "cold_lock_wait_s": [s["lock_wait_s"] for s in cold if s["save_called"]],
        "steps": len(steps),
        "torch_threads": threads,
    }
