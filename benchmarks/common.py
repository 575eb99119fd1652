"""Helpers every section shares: timing, state setup, per-run directories."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import BenchConfig
from .state import make_state


def now() -> float:
    return time.perf_counter()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_state(cfg: BenchConfig, size: int | None = None) -> dict[str, Any]:
    return make_state(cfg.size_bytes if size is None else size, seed=cfg.seed, device=cfg.device)


def fresh_dir(path: Path) -> Path:
    """An empty directory at ``path`` (removing a previous run's files outside any timing)."""
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def timed(fn: Callable[[], Any], device: str = "cpu") -> float:
    t0 = now()
    fn()
    sync(device)
    return now() - t0


def as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a host tensor, without a copy (any dtype, bf16 included)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data
