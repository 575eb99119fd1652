"""A save that replaces an id whose old checkpoint another process deletes (`prune`, a retention pass of a
second job, `rm -r`) at the moment of the swap: the id is then empty, so the save commits by moving in.

Before: the atomic exchange (renameat2 RENAME_EXCHANGE) found nothing to exchange with and the save failed
with `FileNotFoundError: ... (swapping .step_1.tmp-... into place): 'step_1'`; on a filesystem without the
exchange, the rename of the old copy aside failed the same way. Seen for real: 2 of 150 saves replacing
`step_1` failed while `prune` ran in a loop in another process. Here the other process's deletion is made to
land in that window: the real `delete_checkpoint` runs right before the swap's first rename.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.retention import delete_checkpoint
from torch_checkpointing.storage import filesystem
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage


def _save(target: Path, value: float) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(target), {"model": {"w": torch.full((8,), value)}})


def _deleted_first(target: Path, then: Any) -> Any:
    """`then`, once the checkpoint at `target` was deleted as a concurrent prune deletes it."""
    done: list[bool] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            assert delete_checkpoint(target)
        return then(*args, **kwargs)

    return call


def _check(run: Path) -> None:
    with CheckpointManager(CheckpointManager.Config()) as manager:
        assert torch.equal(manager.load(str(run / "step_1"))["model"]["w"], torch.full((8,), 2.0))
    assert [c.name for c in list_checkpoints(run)] == ["step_1"]
    assert list_leftovers(run) == []


def test_with_the_atomic_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = filesystem._renameat2()
    if real is None:
        pytest.skip("this platform has no renameat2: the fallback test covers it")
    run = tmp_path / "run"
    _save(run / "step_1", 1.0)
    monkeypatch.setattr(filesystem, "_renameat2", lambda: _deleted_first(run / "step_1", real))
    _save(run / "step_1", 2.0)
    _check(run)


def test_without_the_atomic_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _save(run / "step_1", 1.0)
    monkeypatch.setattr(filesystem, "_renameat2", lambda: None)
    real_rename = LocalFileSystemStorage.rename
    deleting_first = _deleted_first(run / "step_1", real_rename)

    def rename(self: LocalFileSystemStorage, src: Path, dst: Path, *args: Any, **kwargs: Any) -> None:
        if Path(dst).name.startswith(".old_"):  # the replace moving the old copy aside
            deleting_first(self, src, dst, *args, **kwargs)
        else:
            real_rename(self, src, dst, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystemStorage, "rename", rename)
    _save(run / "step_1", 2.0)
    _check(run)
