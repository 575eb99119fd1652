"""The staging write lock is released exactly once per save, whatever the staging copy does.

A second release clears the write side whoever holds it then: a prewarm_staging() or save() from another
thread that took the lock in between would have its staging copy run while a `with manager.lock():` block
(an optimizer step) updates the very tensors it copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.lock import RWLockMode
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def _count_write_releases(manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    lock = manager._saver._staging_lock  # type: ignore[attr-defined]
    released: list[int] = []
    real = lock.release

    def counting(mode: RWLockMode, token: object | None = None) -> bool:
        done = real(mode, token)
        if mode is RWLockMode.WRITE and done:  # a release that gave a hold back (a token's second is a no-op)
            released.append(1)
        return done

    monkeypatch.setattr(lock, "release", counting)
    return released


@pytest.mark.parametrize("async_staging", [False, True])
def test_a_failed_staging_copy_releases_the_write_lock_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_staging: bool
) -> None:
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.staging_config.use_async_staging = async_staging
    with CheckpointManager(config) as manager:
        released = _count_write_releases(manager, monkeypatch)

        def failing_stage(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("staging copy failed")

        monkeypatch.setattr(manager._saver._stager, "stage", failing_stage)  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="staging copy failed"):
            future = manager.save(str(tmp_path / "a"), {"w": torch.ones(4)})
            assert future is not None
            future.result(timeout=120)
        assert released == [1]
        monkeypatch.undo()
        manager.save(str(tmp_path / "b"), {"w": torch.ones(4)}).result(timeout=120)  # type: ignore[union-attr]
        assert torch.equal(manager.load(str(tmp_path / "b"), into={"w": None})["w"], torch.ones(4))


def test_with_no_wait_timeout_the_staging_lock_wait_is_still_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """API_SURFACE §10: save() waits for the staging lock `wait_timeout_secs`, or 600 s if None, then raises the
    deadlock RuntimeError. With None it waited forever (a lock() never released hung the save)."""
    import threading

    import torch_checkpointing.checkpoint_saver as saver_module

    monkeypatch.setattr(saver_module, "DEFAULT_ACQUIRE_TIMEOUT_SECS", 0.5, raising=False)  # the 600 s, shortened
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = None
    with CheckpointManager(config) as manager:
        held, release = threading.Event(), threading.Event()

        def hold_lock() -> None:
            with manager.lock():
                held.set()
                release.wait(60)

        holder = threading.Thread(target=hold_lock, daemon=True)
        holder.start()
        assert held.wait(30)
        outcome: list[BaseException | None] = []

        def save() -> None:
            try:
                manager.save(str(tmp_path / "a"), {"w": torch.ones(4)})
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        saving = threading.Thread(target=save, daemon=True)
        saving.start()
        saving.join(20)
        release.set()
        holder.join(30)
        saving.join(30)
    assert outcome and isinstance(outcome[0], RuntimeError), outcome
    assert "lock" in str(outcome[0]) and "deadlock" in str(outcome[0])
