"""In the launching process: one launch per phase, then merge rows into a report."""

from __future__ import annotations

import json
import os
import time
from typing import TextIO

from simulator.backend import BACKEND_ENV
from simulator.launcher import LaunchError, launch
from simulator.plan import Plan
from simulator.report import CheckResult, Report, merge_ranks
from simulator.runner import phase_needed, results_file, run_phase


def _read_rows(plan: Plan, phase: str, world: int) -> list[tuple[str, str, list[CheckResult]]]:
    grouped: dict[tuple[str, str], list[CheckResult]] = {}
    for rank in range(world):
        path = results_file(plan, phase, rank)
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            data = json.loads(line)
            data.pop("phase")
            row = CheckResult(**data)
            grouped.setdefault((row.scenario, row.check), []).append(row)
    return [(s, c, rows) for (s, c), rows in grouped.items()]


def run_plan(plan: Plan, *, timeout: float, out: TextIO) -> Report:
    """Run the save phase on the source world, then the load phase on the target world."""
    os.environ[BACKEND_ENV] = plan.backend
    report = Report(backend=plan.backend, world=plan.world_label, mesh=plan.mesh_label, seed=plan.seed)
    start = time.perf_counter()
    print(
        f"simulator: backend {plan.backend}, world {plan.world_label}, mesh {plan.mesh_label}, "
        f"seed {plan.seed}, scenarios {', '.join(plan.scenarios)}",
        file=out,
        flush=True,
    )
    print(f"checkpoints under {plan.root}", file=out, flush=True)
    order = {name: i for i, name in enumerate(plan.scenarios)}
    for phase, world in (("save", plan.save_world), ("load", plan.load_world)):
        if not phase_needed(plan, phase):
            continue
        current = {"scenario": "(starting ranks)"}

        def show(line: str, current: dict[str, str] = current) -> None:
            parts = line.split(" · ")
            if len(parts) == 3:
                current["scenario"] = parts[1]
            print(f"  {line}", file=out, flush=True)

        phase_start = time.perf_counter()
        print(f"▶ {phase} phase: launching {world} rank(s)", file=out, flush=True)
        try:
            launch(
                run_phase,
                world,
                args=(plan, phase),
                timeout=timeout,
                env={BACKEND_ENV: plan.backend},
                progress=show,
                name=f"simulator-{phase}",
            )
        except LaunchError as exc:
            report.errors.append(f"{phase} phase, scenario {current['scenario']}: {exc}")
            print(f"✗ {phase} phase failed in scenario {current['scenario']}", file=out, flush=True)
        else:
            print(f"✓ {phase} phase finished in {time.perf_counter() - phase_start:.1f}s", file=out, flush=True)
        rows = _read_rows(plan, phase, world)
        rows.sort(key=lambda item: order.get(item[0], 99))
        report.rows.extend(merge_ranks(r) for _, _, r in rows)
        if report.errors:
            break
    report.rows.sort(key=lambda r: order.get(r.scenario, 99))
    report.seconds = time.perf_counter() - start
    print("", file=out)
    print(report.table(), file=out)
    print("", file=out)
    print(report.verdict(), file=out, flush=True)
    return report
