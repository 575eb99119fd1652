"""What close() says about a retention pass it gave up on is what became of the pass.

close() read which pass was running only after it gave up: a pass that finished in between (its deletions
done) was reported as "did not finish ... stopped before deleting anything". The window is held open by
finishing the pass inside close()'s give-up (the race a loaded machine produces), and the removal is held by a
storage subclass gated on an event, on the retention thread only, so that close()'s wait times out under it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy, RetentionRunner
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

_HANG_S = 60.0  # only to stop a hang
_OLD = 4


class _HeldRemoval(LocalFileSystemStorage):
    """Its removals on the retention thread wait for `release` (a store slow to delete a large checkpoint)."""

    entered = threading.Event()
    release = threading.Event()

    def rmdir(self, path: Path) -> None:
        if threading.current_thread().name.startswith("ckpt-retention"):
            self.entered.set()
            self.release.wait(_HANG_S)
        super().rmdir(path)


def _checkpoints(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("step_"))


def test_a_pass_that_finished_as_close_gave_up_is_not_said_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in range(1, _OLD + 1):
            manager.save(str(tmp_path / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)
    storage = _HeldRemoval(LocalFileSystemStorageConfig(use_direct_io=False))
    runner = RetentionRunner(RetentionPolicy(keep_last=1), 0, storage)
    give_up = runner._give_up

    def finish_then_give_up(*args: Any, **kwargs: Any) -> Any:
        storage.release.set()
        runner.wait(_HANG_S)  # the pass ends (deleting all it chose) before close() looks at it
        return give_up(*args, **kwargs)

    runner._give_up = finish_then_give_up  # type: ignore[method-assign]
    try:
        runner.after_commit(str(tmp_path / f"step_{_OLD}"), None)
        assert storage.entered.wait(_HANG_S), "the pass never removed a checkpoint: the test proves nothing"
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            runner.close(0.1)
    finally:
        storage.release.set()
    assert _checkpoints(tmp_path) == [f"step_{_OLD}"], "the pass did not finish: the test proves nothing"
    said = [r.getMessage() for r in caplog.records if "etention pass" in r.getMessage()]
    assert said == [], (
        said
    )  # before: "... did not finish within 0.1s of close(); they are stopped before deleting anything."
