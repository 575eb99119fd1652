"""Trainer programs for the process-level safe-save tests, run as `python -c` children of the test.

Each takes a control directory (`tests.memory_storage.Control`) through which the test blocks the save
mid-file, and prints one JSON line saying what it saw.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from tests.memory_storage import Control, RecordingStorageConfig
from tests.probes import stop
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig


def _manager(control_dir: str, async_save: bool, wait_timeout: int) -> CheckpointManager:
    save = AsyncCheckpointSaverConfig if async_save else SyncCheckpointSaverConfig
    return CheckpointManager(
        CheckpointManager.Config(
            save=save(wait_timeout_secs=wait_timeout), storage_config=RecordingStorageConfig(control_dir=control_dir)
        )
    )


def _payload(tag: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((8,), tag)}}


def _say(**what: Any) -> None:
    print(json.dumps(what), flush=True)


def async_save_then_wait(control_dir: str, target: str, tag: float) -> None:
    """Start an async save and idle; the test kills or interrupts us while the writer is blocked."""
    manager = _manager(control_dir, True, 60)
    manager.save(target, _payload(tag))
    _say(saving=True)
    time.sleep(600)


def async_save_stop_writer_and_exit(control_dir: str, target: str) -> None:
    """Leave without close() while the writer is stopped: interpreter exit must not hang."""
    manager = _manager(control_dir, True, 3)
    manager.save(target, _payload(1.0))
    pid = Control(control_dir).wait_blocked(120)
    stop(pid)
    Control(control_dir).reset()
    _say(writer=pid)


def sync_save_interrupted(control_dir: str, target: str) -> None:
    """A sync save that the test interrupts with SIGINT: report what the caller sees."""
    manager = _manager(control_dir, False, 60)
    try:
        manager.save(target, _payload(1.0))
        _say(type=None, message="")
    except BaseException as exc:
        parent = Path(target).parent
        _say(type=type(exc).__name__, message=str(exc), left=sorted(p.name for p in parent.iterdir()))
