"""Runs each section in its own spawned process, bounded by a timeout.

Isolation matters for the numbers, not only for robustness: peak RSS is a
per-process high-water mark, and an engine crash or hang in one section must
leave the other sections' figures (and the report) intact.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .config import BenchConfig


def _child(section: str, cfg: BenchConfig, workdir: Path, conn: Connection) -> None:
    try:
        mod = importlib.import_module(f"benchmarks.{section}")
        result: dict[str, Any] = mod.run(cfg, workdir)
        conn.send({"ok": True, "result": result})
    except BaseException as exc:  # report every failure, the parent decides
        conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    finally:
        conn.close()


def run_section(section: str, cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    """{"result": {...}} or {"error": "...", "traceback": "..."}; never raises."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(section, cfg, workdir, child), name=f"bench-{section}")
    t0 = time.perf_counter()
    proc.start()
    child.close()
    reply: dict[str, Any] | None = None
    answered = parent.poll(cfg.section_timeout_s)
    if answered:
        try:
            reply = parent.recv()
        except EOFError:
            reply = None
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    wall = time.perf_counter() - t0
    if reply is None:
        why = (
            f"process exited with code {proc.exitcode} without a result"
            if answered
            else f"timed out after {cfg.section_timeout_s:.0f}s"
        )
        return {"error": why, "wall_s": wall}
    if reply["ok"]:
        return {"result": reply["result"], "wall_s": wall}
    return {"error": reply["error"], "traceback": reply["traceback"], "wall_s": wall}


def run_all(cfg: BenchConfig, log: Any = print) -> dict[str, dict[str, Any]]:
    cfg.work_parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="run-", dir=cfg.work_parent) as tmp:
        for section in cfg.sections:
            log(f"[bench] {section} ...")
            res = run_section(section, cfg, Path(tmp) / section)
            status = "ok" if "result" in res else f"ERROR: {res['error']}"
            log(f"[bench] {section}: {status} ({res['wall_s']:.1f}s)")
            results[section] = res
    return results
