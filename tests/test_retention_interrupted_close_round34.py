"""A retention pass whose close() was interrupted (Ctrl-C) deletes nothing more once close() has raised.

close() stops a retention pass at its next safe point when it gives up waiting for it at its timeout. A Ctrl-C
in that wait gave up on it too, but the pass was neither stopped nor its worker shut down: close() raised
KeyboardInterrupt over a manager closed for good (a second close() returns at once), and the pass went on
deleting checkpoint after checkpoint on its daemon thread, in a notebook or a script that caught the interrupt
and built its next manager beside it. Now an interrupt stops the pass as the timeout does.

The interrupt is a real SIGINT to this process. The removal is held by a storage subclass gated on an event, on
the retention thread only: no real store's removal can be held at a chosen point from a test.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.test_retention_after_close_round34 import retention_threads_end
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

_HANG_S = 60.0  # only to stop a hang
_SIGNAL_AFTER_S = 0.5  # close() is waiting for the held pass by then
_OLD = 4
_ENTERED = threading.Event()
_RELEASE = threading.Event()


@dataclass
class _HeldRemovalConfig(LocalFileSystemStorageConfig):
    def create_storage(self) -> LocalFileSystemStorage:
        return _HeldRemoval(self)


class _HeldRemoval(LocalFileSystemStorage):
    """Its removals on the retention thread wait for `_RELEASE` (a store slow to delete a large checkpoint)."""

    def rmdir(self, path: Path) -> None:
        if threading.current_thread().name.startswith("ckpt-retention"):
            _ENTERED.set()
            _RELEASE.wait(_HANG_S)
        super().rmdir(path)


def _checkpoints(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("step_"))


def test_a_pass_whose_close_was_interrupted_deletes_nothing_more(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in range(1, _OLD + 1):
            manager.save(str(tmp_path / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(wait_timeout_secs=_HANG_S),
        storage_config=_HeldRemovalConfig(use_direct_io=False),
        retention=RetentionPolicy(keep_last=1),
    )
    _ENTERED.clear()
    _RELEASE.clear()
    manager = CheckpointManager(config)
    runner = manager._retention
    assert runner is not None
    interrupt = threading.Timer(_SIGNAL_AFTER_S, os.kill, (os.getpid(), signal.SIGINT))
    try:
        manager.save(str(tmp_path / f"step_{_OLD + 1}"), {"m": {"x": torch.ones(2)}}, step=_OLD + 1)
        assert _ENTERED.wait(_HANG_S)  # the pass is removing its first checkpoint
        interrupt.start()
        with pytest.raises(KeyboardInterrupt):
            manager.close()
        left_at_close = _checkpoints(tmp_path)
    finally:
        interrupt.cancel()
        _RELEASE.set()
        manager.close()
    runner.wait(_HANG_S)  # the pass has ended, stopped or not
    assert len(left_at_close) > 1, "the pass ended before the interrupt: the test did not reach what it checks"
    assert _checkpoints(tmp_path) == left_at_close, "the pass deleted checkpoints after close() was interrupted"
    retention_threads_end(before)  # and its worker was shut down, not left waiting for more passes
