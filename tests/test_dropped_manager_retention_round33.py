"""A manager dropped without close() waits for its last save before it closes retention, as close() does.

Before, the dropped manager's close closed retention first: its pass for the last save was waited for by
retention's own 600 s, not save.wait_timeout_secs, and a write still running past it had its pass skipped
silently (the worker was gone when the write committed). Now the last save is waited for (bounded by
save.wait_timeout_secs), then the retention passes, then the writer goes: close()'s order.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.retention import RetentionPolicy, RetentionRunner
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
from torch_checkpointing.waiting import Deadline


@dataclasses.dataclass
class GatedStorageConfig(LocalFileSystemStorageConfig):
    """Renames onto an id named `step_2` wait until the file `gate` exists (in whichever process commits)."""

    gate: str = ""

    def create_storage(self) -> LocalFileSystemStorage:
        return _GatedStorage(config=self, gate=self.gate)


class _GatedStorage(LocalFileSystemStorage):
    def __init__(self, config: LocalFileSystemStorageConfig, gate: str) -> None:
        super().__init__(config=config)
        self._gate = gate

    def rename(self, src_path: Path, dst_path: Path, *args: object, **kwargs: object) -> None:
        deadline = Deadline(60.0)  # only stops a hang
        while Path(dst_path).name == "step_2" and not os.path.exists(self._gate) and deadline.left():
            threading.Event().wait(0.05)
        super().rename(src_path, dst_path, *args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.drops_manager  # it tests what a dropped manager's finalizer does
def test_a_dropped_manager_closes_retention_after_the_last_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    config = CheckpointManager.Config()
    config.storage_config = GatedStorageConfig(use_direct_io=False, gate=str(gate))
    config.retention = RetentionPolicy(keep_last=1)
    saves = []
    seen_at_close: list[bool] = []
    real_close = RetentionRunner.close

    def spied_close(self: RetentionRunner, timeout: float | None = 600.0) -> None:
        seen_at_close.append(saves[-1].done())
        gate.touch()  # the write may finish now, whichever order the close took
        real_close(self, timeout)

    monkeypatch.setattr(RetentionRunner, "close", spied_close)
    manager = CheckpointManager(config)
    manager.save(str(tmp_path / "run" / "step_1"), {"model": {"w": torch.ones(4)}}).result(60)
    saves.append(manager.save(str(tmp_path / "run" / "step_2"), {"model": {"w": torch.ones(4)}}))
    threading.Timer(5.0, gate.touch).start()  # the last save commits while the dropped manager waits for it
    del manager
    gc.collect()
    for thread in threading.enumerate():
        if thread.name == "ckpt-dropped-close":
            thread.join(120)
    assert seen_at_close == [True], seen_at_close  # the last save was done when retention closed
    assert saves[-1].done() and saves[-1].exception() is None
    assert sorted(os.listdir(tmp_path / "run")) == ["step_2"]  # its retention pass ran
