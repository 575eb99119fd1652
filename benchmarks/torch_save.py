"""Baseline: torch.save (+ fsync, so it is durable like the others) and
torch.load followed by a copy into the templates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .common import build_state, fresh_dir, now, remove, sync
from .config import BenchConfig
from .state import make_templates, same_values, tensors_of
from .sysinfo import drop_page_cache, fsync_dir


def save_durable(state: Any, path: Path) -> float:
    t0 = now()
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return now() - t0


def load_into(path: Path, templates: Any, device: str) -> float:
    t0 = now()
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    for dst, src in zip(tensors_of(templates), tensors_of(loaded), strict=True):
        dst.copy_(src)
    sync(device)
    return now() - t0


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    state = build_state(cfg)
    d = fresh_dir(workdir / "torch_save")
    d.mkdir()
    saves = []
    for i in range(cfg.runs):
        path = d / f"state_{i}.pt"
        saves.append(save_durable(state, path))
        if i + 1 < cfg.runs:
            remove(path)
    out: dict[str, Any] = {"save_durable_s": saves}
    if not cfg.saves_only:
        path = d / f"state_{cfg.runs - 1}.pt"
        templates = make_templates(state)
        cold, warm = [], []
        for _ in range(cfg.runs):
            drop_page_cache(path)
            cold.append(load_into(path, templates, cfg.device))
            warm.append(load_into(path, templates, cfg.device))
        if not same_values(templates, state):
            raise RuntimeError("torch.load baseline loaded different values than were saved")
        out["load_cold_s"] = cold
        out["load_warm_s"] = warm
    remove(d)
    return out
