"""A retention pass that close() stopped waiting for deletes nothing more once close() has returned.

close() waits for the retention passes within save.wait_timeout_secs; past it, it returned and the pass went on
on its daemon thread, deleting checkpoint after checkpoint while the script believed the manager closed (and
its next manager, or an operator, worked beside it). Now close() stops the pass at its next safe point (between
two deletions): the one deletion under way finishes (or, cut at interpreter exit, leaves a trash folder that
gc collects and no load takes for a checkpoint), and the WARNING says so, naming the root.

The removal is slowed by a storage subclass gated on an event, on the retention thread only: no real store's
removal can be held at a chosen point from a test, and the pass must be held there for close() to give up on it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig, list_checkpoints
from torch_checkpointing.retention import RetentionPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

_WAIT_S = 1
_HANG_S = 60.0  # only to stop a hang
_OLD = 4
_ENTERED = threading.Event()
_RELEASE = threading.Event()


@dataclass
class _SlowRemovalConfig(LocalFileSystemStorageConfig):
    def create_storage(self) -> LocalFileSystemStorage:
        return _SlowRemoval(self)


class _SlowRemoval(LocalFileSystemStorage):
    """Its removals on the retention thread wait for `_RELEASE` (a store slow to delete a large checkpoint)."""

    def rmdir(self, path: Path) -> None:
        if threading.current_thread().name.startswith("ckpt-retention"):
            _ENTERED.set()
            _RELEASE.wait(_HANG_S)
        super().rmdir(path)


def _save_old_checkpoints(root: Path) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in range(1, _OLD + 1):
            manager.save(str(root / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)


def retention_threads_end(before: set[threading.Thread]) -> None:
    """This test's retention threads (not those an earlier test left to end on their own: one that never ends
    there, a store that stopped answering, failed this test)."""
    for thread in set(threading.enumerate()) - before:
        if thread.name.startswith("ckpt-retention"):
            thread.join(_HANG_S)
            assert not thread.is_alive(), "the retention pass never ended"


def _checkpoints(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("step_"))


def test_a_pass_close_gave_up_on_deletes_nothing_more(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = set(threading.enumerate())
    _save_old_checkpoints(tmp_path)
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(wait_timeout_secs=_WAIT_S),
        storage_config=_SlowRemovalConfig(use_direct_io=False),
        retention=RetentionPolicy(keep_last=1),
    )
    _ENTERED.clear()
    _RELEASE.clear()
    manager = CheckpointManager(config)
    try:
        manager.save(str(tmp_path / f"step_{_OLD + 1}"), {"m": {"x": torch.ones(2)}}, step=_OLD + 1)
        assert _ENTERED.wait(_HANG_S)  # the pass is removing its first checkpoint
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            manager.close()
        left_at_close = _checkpoints(tmp_path)
    finally:
        _RELEASE.set()
        manager.close()
    retention_threads_end(before)
    assert _checkpoints(tmp_path) == left_at_close, "the pass deleted checkpoints after close() returned"
    said = [r.getMessage() for r in caplog.records if "did not finish within" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert str(tmp_path) in said[0] and "no further checkpoint" in said[0], said[0]


_SCRIPT = """
import sys, threading
from dataclasses import dataclass
from pathlib import Path
import torch
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig, list_checkpoints
from torch_checkpointing.retention import RetentionPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
ENTERED = threading.Event()

@dataclass
class Config(LocalFileSystemStorageConfig):
    def create_storage(self):
        return Storage(self)

class Storage(LocalFileSystemStorage):
    def rmdir(self, path):  # removes half of the files, then never finishes (the interpreter exits under it)
        if threading.current_thread().name.startswith("ckpt-retention"):
            for name in sorted(p.name for p in path.iterdir())[:1]:
                (path / name).unlink()
            ENTERED.set()
            threading.Event().wait(600)
        super().rmdir(path)

if __name__ == "__main__":
    root = Path(sys.argv[1])
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(wait_timeout_secs=1),
        storage_config=Config(use_direct_io=False),
        retention=RetentionPolicy(keep_last=1),
    )
    manager = CheckpointManager(config)
    manager.save(str(root / "step_9"), {"m": {"x": torch.ones(2)}}, step=9)
    assert ENTERED.wait(60)
    manager.close()
"""


def test_a_pass_cut_at_interpreter_exit_leaves_what_gc_collects(tmp_path: Path) -> None:
    """The deletion under way when the script exits is cut there (a daemon thread): what it leaves is a trash
    folder, which no load takes for a checkpoint and gc removes; the checkpoints after it were never touched."""
    _save_old_checkpoints(tmp_path)
    script = tmp_path.parent / f"{tmp_path.name}_train.py"
    script.write_text(_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    kept = [f"step_{step}" for step in range(2, _OLD + 1)] + ["step_9"]
    assert _checkpoints(tmp_path) == kept, os.listdir(tmp_path)
    trash = [name for name in os.listdir(tmp_path) if not name.startswith("step_")]
    assert trash, "the deletion was not cut: the test did not reach what it checks"
    listed = [Path(c.path).name for c in list_checkpoints(str(tmp_path))]
    assert listed == kept, listed  # the cut deletion is no checkpoint to a listing (nor to a load by step)
    gc = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", "gc", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert sorted(os.listdir(tmp_path)) == kept, gc.stdout
