"""Helpers shared by the multirank tests (the async saves of rounds 21 and 22, the interrupted ranks of rounds 28
and 29): their job functions run in spawned ranks, which import this module by name, so everything here is a
plain module-level name."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from simulator.launcher import launch
from tests.memory_storage import RecordingStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


class WarningLines(logging.Handler):
    """Collects the messages of the WARNING (and above) records it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def state(step: int, rank: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((4,), float(step * 10 + rank))}}


def outcome(future: Any, timeout_s: float) -> str:
    """The string "ok" once the save is done, or its failure as `Type: message`."""
    try:
        future.result(timeout_s)
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def timed(call: Callable[[], Any]) -> dict[str, Any]:
    """`call()`: "ok" or its failure as `Type: message` (`result`), and how long it took (`elapsed`)."""
    started = time.monotonic()
    try:
        call()
        result = "ok"
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"
    return {"result": result, "elapsed": time.monotonic() - started}


def local_async_manager(wait_s: float) -> CheckpointManager:
    """An async-save manager on the local file system (no direct I/O) whose saves wait `wait_s` at most."""
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = wait_s
    return CheckpointManager(config)


def local_sync_manager(wait_s: int) -> CheckpointManager:
    """A sync-save manager on the local file system (no direct I/O) whose collective steps wait `wait_s` at most
    (save.wait_timeout_secs: the gloo group's timeout too)."""
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = wait_s
    return CheckpointManager(config)


def said(call: Callable[[], Any], *, notes: bool = False) -> str:
    """`call()`: "ok", or what it raised (an interrupt too) as `Type: message`, with its notes after " | " where
    `notes`."""
    try:
        call()
    except BaseException as exc:
        return " | ".join([f"{type(exc).__name__}: {exc}", *(getattr(exc, "__notes__", []) if notes else [])])
    return "ok"


def loaded(manager: CheckpointManager, path: str) -> Any:
    """The first value of `model.w` loaded from `path`, or the load's failure as `Type: message`."""
    try:
        return float(manager.load(path, {"model": {"w": torch.zeros(4)}})["model"]["w"][0])
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"


def async_manager(control_dir: str, wait_s: float) -> tuple[CheckpointManager, WarningLines]:
    """An async-save manager on `RecordingStorageConfig(control_dir)` whose saves wait `wait_s` at most, and the
    handler collecting the `torch_checkpointing` logger's WARNING lines from then on."""
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = RecordingStorageConfig(control_dir=control_dir)
    config.save.wait_timeout_secs = wait_s
    warnings = WarningLines()
    logging.getLogger("torch_checkpointing").addHandler(warnings)
    return CheckpointManager(config), warnings


def after_and_close(
    manager: CheckpointManager, warnings: WarningLines, root: str, rank: int, out: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """How each job ends: one more save (`after`, of step 4) and its load, the WARNING lines said, the manager
    closed. Returns `out`, with all of that in it."""
    out["after"] = outcome(manager.save(f"{root}/after", state(4, rank)), timeout_s)
    out["after_loaded"] = loaded(manager, f"{root}/after")
    out["warnings"] = warnings.lines
    manager.close()
    return out


def launch_job(
    job: Callable[[str, str], dict[str, Any]], world: int, tmp: Path, timeout: float
) -> list[dict[str, Any]]:
    """`job(root, control_root)` on `world` ranks, its checkpoints under `tmp/ck`, its controls under `tmp/control`."""
    root = tmp / "ck"
    root.mkdir()
    return launch(job, world, args=(str(root), str(tmp / "control")), timeout=timeout)
