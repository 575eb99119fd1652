"""A Ctrl-C inside `save()` just after its write was handed to the comm thread.

Under a storm of SIGINTs (test_lifecycle_round9_interrupts) one run in three ended with every later save refused
after `wait_timeout_secs`: the interrupted save() failed its Future itself while its write job was still queued,
and a second interrupt, landing inside `threading.Condition.__enter__` of that Future on the training thread,
left the Future's lock held by that thread. The queued job then waited for the lock forever in `set_result`, and
every later save's job, queued behind it on the same thread, never ran. The test leaves the lock held by hand
(exactly what such an interrupt leaves) instead of waiting for the storm to find the window.

It also pins what the interrupted save means: save() raised, the caller was told it failed, so it must not
commit later behind the caller's back.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_saver import _DaemonWorker


def test_an_interrupt_after_the_hand_over_neither_commits_nor_wedges_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CheckpointManager.Config.with_async_save()
    config.save.wait_timeout_secs = 10
    manager = CheckpointManager(config)
    interrupted: list[bool] = []
    leaked: list[threading.Condition] = []  # the Future's Condition, left held below
    try:
        manager.save(str(tmp_path / "first"), {"w": torch.zeros(8)}).result(60)
        comm = manager._saver._comm  # type: ignore[attr-defined]
        real_submit = _DaemonWorker.submit
        go = threading.Event()

        def interrupted_submit(self: _DaemonWorker, job: object) -> None:
            if self is not comm or interrupted:
                real_submit(self, job)  # type: ignore[arg-type]
                return
            real_submit(self, lambda: (go.wait(10), job()))  # type: ignore[operator]
            interrupted.append(True)
            raise KeyboardInterrupt

        monkeypatch.setattr(_DaemonWorker, "submit", interrupted_submit)
        with pytest.raises(KeyboardInterrupt):
            manager.save(str(tmp_path / "second"), {"w": torch.ones(8)})
        write = manager._saver._last_write  # type: ignore[attr-defined]
        write._condition.acquire()  # what an interrupt inside Condition.__enter__ leaves on this thread
        leaked.append(write._condition)
        go.set()
        manager.save(str(tmp_path / "third"), {"w": torch.full((8,), 3.0)}).result(15)
        into = {"w": torch.zeros(8)}
        manager.load(str(tmp_path / "third"), into=into)
        assert torch.equal(into["w"], torch.full((8,), 3.0))
        assert not (tmp_path / "second").exists()  # save() raised: it was never committed behind the caller's back
    finally:
        for condition in leaked:
            condition.release()
        manager.close()
