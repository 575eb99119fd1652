"""A Ctrl-C that lands after the swap says the save was committed, and leaves the committed checkpoint alone.

Replacing a checkpoint swaps the new one into place, then removes the replaced copy and fsyncs the parent. A
SIGINT during that tail was reported as "nothing was committed", while the id held the new checkpoint (2 of 8
random Ctrl-Cs in a loop of sync saves over one id). Here a real SIGINT is sent to this process right at the
end of the swap.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig


@dataclass
class _InterruptAfterSwapConfig(LocalFileSystemStorageConfig):
    def create_storage(self) -> LocalFileSystemStorage:
        return _InterruptAfterSwap(self)


class _InterruptAfterSwap(LocalFileSystemStorage):
    """Sends this process a SIGINT the moment the new checkpoint is swapped into place."""

    def replace_directory(self, src: Path, dst: Path) -> None:
        super().replace_directory(src, dst)
        os.kill(os.getpid(), signal.SIGINT)


def _manager(storage: LocalFileSystemStorageConfig) -> CheckpointManager:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = storage
    return CheckpointManager(config)


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, which the save's interrupt reporting takes over (a test runner's worker may
    have replaced or ignored it); signals reach only the main thread."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can be set on the main thread only")
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("default_sigint")
def test_a_ctrl_c_after_the_swap_reports_the_commit(tmp_path: Path) -> None:
    plain = _manager(LocalFileSystemStorageConfig(use_direct_io=False))
    try:
        plain.save(str(tmp_path / "ck"), {"w": torch.full((4,), 1.0)})
    finally:
        plain.close()
    manager = _manager(_InterruptAfterSwapConfig(use_direct_io=False))
    try:
        with pytest.raises(KeyboardInterrupt, match="interrupted by SIGINT \\(Ctrl-C\\): it was committed"):
            manager.save(str(tmp_path / "ck"), {"w": torch.full((4,), 2.0)})
        assert manager.load(str(tmp_path / "ck"), into={"w": torch.zeros(4)})["w"].eq(2.0).all()
    finally:
        manager.close()
