"""Our engine: blocked time per async save (worst case: nothing overlaps the
staging copy), time to durable, memory over consecutive saves, and load into
templates cold and warm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import build_state, fresh_dir, now, remove, sync
from .config import BenchConfig
from .engine_api import make_manager, no_copy_items
from .state import make_templates, nbytes, same_values
from .sysinfo import descendants, drop_page_cache, proc_mem


def _writer_memory() -> dict[str, int]:
    """Peak RSS of the biggest child process: the background writer."""
    best: dict[str, int] = {}
    for pid in descendants():
        mem = proc_mem(pid)
        if mem.get("VmHWM", 0) > best.get("VmHWM", 0):
            best = {**mem, "pid": pid}
    return best


def save_series(mgr: Any, payload: dict[str, Any], root: Path, n: int) -> dict[str, Any]:
    """n consecutive saves, each waited to durability before the next (the engine
    serialises saves anyway); blocked = save() call until lock() can be entered."""
    blocked, durable, rss = [], [], []
    for i in range(n):
        path = root / f"ckpt_{i}"
        t0 = now()
        fut = mgr.save(str(path), payload)
        with mgr.lock():
            t1 = now()
        if fut is not None:
            fut.result()
        t2 = now()
        blocked.append(t1 - t0)
        durable.append(t2 - t0)
        rss.append(proc_mem().get("VmRSS", 0))
        if i >= 2:
            remove(root / f"ckpt_{i - 2}")
    return {"blocked_s": blocked, "durable_s": durable, "rss_after_save": rss, "last": str(root / f"ckpt_{n - 1}")}


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    state = build_state(cfg)
    root = fresh_dir(workdir / "engine")
    root.mkdir()
    rss_before_manager = proc_mem().get("VmRSS", 0)
    mgr = make_manager(cfg)
    try:
        rss_before = proc_mem().get("VmRSS", 0)
        series = save_series(mgr, state, root, max(cfg.memory_saves, cfg.runs + 1))
        writer = _writer_memory()
        out: dict[str, Any] = {
            "bytes": nbytes(state), "staged_bytes": nbytes(state),
            "blocked_cold_s": series["blocked_s"][0], "durable_cold_s": series["durable_s"][0],
            "blocked_s": series["blocked_s"][1:], "durable_s": series["durable_s"][1:],
            "rss_before_manager": rss_before_manager, "rss_before_first_save": rss_before,
            "rss_after_save": series["rss_after_save"],
            "trainer_peak_rss": proc_mem().get("VmHWM", 0), "writer": writer,
        }
        if not cfg.saves_only:
            last = Path(series["last"])
            templates = make_templates(state)
            cold, warm = [], []
            for _ in range(cfg.runs):
                drop_page_cache(last)
                t0 = now()
                mgr.load(str(last), into=templates)
                sync(cfg.device)
                cold.append(now() - t0)
                t0 = now()
                mgr.load(str(last), into=templates)
                sync(cfg.device)
                warm.append(now() - t0)
            if not same_values(templates, state):
                raise RuntimeError("engine load did not restore the saved values into the templates")
            out["load_cold_s"], out["load_warm_s"] = cold, warm
    finally:
        mgr.close()
    remove(root)
    if cfg.saves_only:
        return out
    root.mkdir()
    nc = make_manager(cfg, items=no_copy_items(list(state)))
    try:
        series = save_series(nc, state, root, cfg.runs + 1)
        out["no_copy_blocked_cold_s"] = series["blocked_s"][0]
        out["no_copy_blocked_s"] = series["blocked_s"][1:]
    finally:
        nc.close()
    remove(root)
    return out
