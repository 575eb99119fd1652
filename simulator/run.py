"""In the launching process: one launch per phase, then merge rows into a report."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

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


def _store(plan: Plan) -> Any:
    from simulator.storage import InstrumentedStorageConfig  # imports the backend (named by BACKEND_ENV)

    return InstrumentedStorageConfig(url=plan.storage_url).create_storage()


def check_storage(plan: Plan) -> str:
    """Why this process cannot write, read and delete an object under --storage-url, in one line ("" if it can)."""
    probe = Path(f"{plan.storage_url}/.simulator-probe")
    try:
        store = _store(plan)
        store.mkdir(Path(plan.storage_url))  # a directory on file://; nothing to do on an object store
        store.write(probe, b"probe")
        data = store.read(probe)
        store.delete(probe)
    except Exception as exc:  # a missing bucket, no endpoint, refused credentials, a missing package
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first[:400]}"
    return "" if data == b"probe" else f"read back {data[:20]!r} instead of the bytes written"


def remove_checkpoints(plan: Plan, out: TextIO) -> None:
    """Delete this run's prefix in the store (a run never shares it: see cli.run_prefix)."""
    try:
        _store(plan).rmdir(Path(plan.storage_url))
    except Exception as exc:
        print(f"could not delete {plan.storage_url}: {type(exc).__name__}: {exc}", file=out, flush=True)


def run_plan(plan: Plan, *, timeout: float, out: TextIO, keep: bool = True) -> Report:
    """Run the save phase on the source world, then the load phase on the target world.

    With ``plan.storage_url`` the store is checked from this process first (a missing bucket or endpoint is one
    clear error, not a failure in every scenario), and this run's prefix is deleted at the end unless ``keep``.
    """
    os.environ[BACKEND_ENV] = plan.backend
    report = Report(backend=plan.backend, world=plan.world_label, mesh=plan.mesh_label, seed=plan.seed)
    start = time.perf_counter()
    print(
        f"simulator: backend {plan.backend}, world {plan.world_label}, mesh {plan.mesh_label}, "
        f"seed {plan.seed}, scenarios {', '.join(plan.scenarios)}",
        file=out,
        flush=True,
    )
    print(f"checkpoints under {plan.checkpoints_at}", file=out, flush=True)
    if plan.storage_url:
        problem = check_storage(plan)
        if problem:
            report.errors.append(
                f"--storage-url {plan.storage_url}: the store is not usable from this process ({problem}); "
                "check that the location exists (on S3: the bucket, and AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY in the environment)"
            )
            report.seconds = time.perf_counter() - start
            print(report.table(), file=out)
            print(report.verdict(), file=out, flush=True)
            return report
    try:
        return _run_phases(plan, report, start, timeout=timeout, out=out)
    finally:
        if plan.storage_url and not keep:
            remove_checkpoints(plan, out)


def _run_phases(plan: Plan, report: Report, start: float, *, timeout: float, out: TextIO) -> Report:
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
