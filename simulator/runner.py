"""Inside a rank: run every chosen scenario's share of one phase, recording rows as they finish.

Rows go to a per-rank JSON-lines file as soon as a scenario ends, so if a later
scenario hangs or crashes the launch, the parent still reports what finished.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from simulator.launcher import report_progress
from simulator.plan import Plan
from simulator.report import FAIL, SKIPPED, CheckResult

_MODULES = {"layouts": "layouts", "async-race": "async_race", "reshard": "reshard", "faults": "faults"}
_PHASES = {
    "layouts": ("save", "load"),
    "async-race": ("save",),
    "reshard": ("save", "load"),
    "faults": ("save", "load"),
}


# Scenarios whose injections act on local files, so they cannot run against --storage-url, and why.
LOCAL_ONLY: dict[str, str] = {
    "faults": (
        "its injections act on local files (RLIMIT_FSIZE for a full disk, a bit flipped in place, a kill-rank job "
        "with its own local directory), so it does not run with --storage-url"
    ),
}


def phase_needed(plan: Plan, phase: str) -> bool:
    """Whether any chosen scenario has work in this phase (starting ranks for nothing costs seconds)."""
    return any(phase in _PHASES[name] for name in plan.scenarios)


def results_file(plan: Plan, phase: str, rank: int) -> Path:
    return Path(plan.root, "_simulator_results", f"{phase}_rank{rank}.jsonl")


def progress_line(phase: str, world: int, scenario: str, message: str) -> str:
    return f"{phase} ×{world} · {scenario} · {message}"


def run_phase(plan: Plan, phase: str) -> int:
    """Entry point given to the launcher; returns the number of rows this rank recorded."""
    out = results_file(plan, phase, dist.get_rank())
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        from simulator.scenarios.common import RankCtx  # imports the backend, so only inside ranks

        ctx = RankCtx(plan, phase)
    except Exception as exc:  # e.g. the backend (or one of its public modules) does not import
        label = str(plan.save_world) if phase == "save" else plan.world_label
        note = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
        failed = [CheckResult(name, phase, label, "-", FAIL, notes=[note]) for name in plan.scenarios]
        _write(out, phase, failed)
        return len(failed)
    count = 0
    for name in plan.scenarios:
        if plan.storage_url and name in LOCAL_ONLY:
            label = str(plan.save_world) if phase == "save" else plan.world_label
            skipped = [CheckResult(name, phase, label, "-", SKIPPED, notes=[f"skipped: {LOCAL_ONLY[name]}"])]
            _write(out, phase, skipped)
            count += 1
            continue
        module = importlib.import_module(f"simulator.scenarios.{_MODULES[name]}")
        step = getattr(module, phase, None)
        if step is None:
            continue
        if ctx.rank == 0:
            report_progress(progress_line(phase, ctx.world, name, "started"))
        try:
            rows: list[CheckResult] = step(ctx)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            rows = [ctx.row(name, phase, FAIL, notes=[f"rank {ctx.rank}: {type(exc).__name__}: {first[:300]}"])]
        _write(out, phase, rows)
        count += len(rows)
        dist.barrier()
        if ctx.rank == 0:
            summary = ", ".join(f"{r.check or r.scenario} {r.result}" for r in rows)
            report_progress(progress_line(phase, ctx.world, name, f"done on rank 0: {summary}"))
    return count


def _write(out: Path, phase: str, rows: list[CheckResult]) -> None:
    with open(out, "a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps({"phase": phase, **asdict(row)}) + "\n")
