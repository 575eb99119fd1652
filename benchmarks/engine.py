"""Our engine: blocked time per async save (worst case: nothing overlaps the
staging copy), time to durable, memory over consecutive saves, and load into
templates cold and warm.

The floors (memory copy, raw write + fsync, raw read) are measured here,
interleaved with our runs: sample i of a floor is taken right before sample i
of ours, so both see the same load on a shared machine and their ratio is
stable even when absolute times are not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import build_state, fresh_dir, now, remove, sync
from .config import BenchConfig
from .engine_api import import_engine, make_manager, no_copy_items
from .floors import CopyFloor, raw_read, raw_write
from .state import make_templates, nbytes, same_values, tensors_of
from .sysinfo import descendants, drop_page_cache, proc_mem


def _writer_memory() -> dict[str, int]:
    """Peak RSS of the biggest child process: the background writer."""
    best: dict[str, int] = {}
    for pid in descendants():
        mem = proc_mem(pid)
        if mem.get("VmHWM", 0) > best.get("VmHWM", 0):
            best = {**mem, "pid": pid}
    return best


class _Floors:
    """Paired floor samples, see the module docstring."""

    def __init__(self, state: dict[str, Any], cfg: BenchConfig, root: Path) -> None:
        tensors = tensors_of(state)
        self.copy = CopyFloor(tensors, cfg.device)
        self.host = [t.cpu() for t in tensors]
        self.raw = root / "raw.bin"
        self.buf = memoryview(bytearray(nbytes(state))) if not cfg.saves_only else None
        self.samples: dict[str, list[float]] = {
            "memcpy_s": [],
            "raw_write_s": [],
            "raw_read_cold_s": [],
            "raw_read_warm_s": [],
        }

    def before_save(self) -> None:
        self.samples["memcpy_s"].append(self.copy.once())
        remove(self.raw)
        self.samples["raw_write_s"].append(raw_write(self.host, self.raw))

    def read(self, cold: bool) -> None:
        assert self.buf is not None
        if cold:
            drop_page_cache(self.raw)
        self.samples["raw_read_cold_s" if cold else "raw_read_warm_s"].append(raw_read(self.raw, self.buf))


def save_series(mgr: Any, payload: dict[str, Any], root: Path, n: int, floors: _Floors | None = None) -> dict[str, Any]:
    """n consecutive saves, each waited to durability before the next (the engine
    serialises saves anyway); blocked = save() call until lock() can be entered."""
    blocked, durable, rss = [], [], []
    for i in range(n):
        if floors is not None:
            floors.before_save()
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
    return {"blocked_s": blocked, "durable_s": durable, "rss_after_save": rss, "last": root / f"ckpt_{n - 1}"}


def _loads(mgr: Any, last: Path, state: dict[str, Any], cfg: BenchConfig, floors: _Floors) -> dict[str, Any]:
    """Default (verifying) loads, cold and warm, each next to its raw-read floor; and, interleaved with them, the
    same loads with `verify_checksums=False`, so that the cost of verification is a ratio within one run."""
    templates = make_templates(state)
    # Sync saves: a manager that only loads needs no writer process, and one spawned here would import torch
    # on the cores the first loads are timed on.
    unverified = make_manager(cfg, verify_checksums=False, sync_save=True)
    keys = ("load_cold_s", "load_warm_s", "unverified_cold_s", "unverified_warm_s")
    out: dict[str, list[float]] = {k: [] for k in keys}
    try:
        for _ in range(cfg.runs):
            for cold in (True, False):
                floors.read(cold)
                for name, manager in (("load", mgr), ("unverified", unverified)):
                    if cold:
                        drop_page_cache(last)
                    t0 = now()
                    manager.load(str(last), into=templates)
                    sync(cfg.device)
                    out[f"{name}_{'cold' if cold else 'warm'}_s"].append(now() - t0)
    finally:
        unverified.close()
    if not same_values(templates, state):
        raise RuntimeError("engine load did not restore the saved values into the templates")
    return out


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    state = build_state(cfg)
    root = fresh_dir(workdir / "engine")
    root.mkdir()
    floors = _Floors(state, cfg, workdir)
    import_engine()
    rss_before_manager = proc_mem().get("VmRSS", 0)
    t0 = now()
    mgr = make_manager(cfg)
    ctor_s = now() - t0
    try:
        rss_before = proc_mem().get("VmRSS", 0)
        n = max(cfg.memory_saves, cfg.runs + 1)
        series = save_series(mgr, state, root, n, floors)
        writer = _writer_memory()
        out: dict[str, Any] = {
            "bytes": nbytes(state),
            "staged_bytes": nbytes(state),
            "device": cfg.device,
            "blocked_cold_s": series["blocked_s"][0],
            "durable_cold_s": series["durable_s"][0],
            "blocked_s": series["blocked_s"][1:],
            "durable_s": series["durable_s"][1:],
            "rss_before_manager": rss_before_manager,
            "rss_before_first_save": rss_before,
            "rss_after_save": series["rss_after_save"],
            "trainer_peak_rss": proc_mem().get("VmHWM", 0),
            "writer": writer,
            "ctor_s": ctor_s,
        }
        if not cfg.saves_only:
            out.update(_loads(mgr, series["last"], state, cfg, floors))
    finally:
        t0 = now()
        mgr.close()
    out["close_s"] = now() - t0  # nothing in flight: every save was waited for
    # Floor sample 0 pairs with the cold save: keep the warm pairs only.
    out.update({k: (v[1:] if k in ("memcpy_s", "raw_write_s") else v) for k, v in floors.samples.items()})
    remove(root)
    remove(floors.raw)
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
