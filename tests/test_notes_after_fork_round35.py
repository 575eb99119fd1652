"""The config notes' lock in a child forked while another thread held it (round 35).

`warn_once` holds the notes' lock while it warns (a `showwarning` hook, a logging handler: any time). A process
forked meanwhile (a DataLoader worker, a helper forked by the trainer) got the lock held by a thread that does
not exist in it: its first note of a config (a copy of a storage config unpickled there, a config built there)
waited for good.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from typing import Any

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import notes_of

_HANG_S = 60.0  # the child's note takes microseconds; this only stops a hang


def _child_status(pid: int) -> int | None:
    """The child's wait status, or None if it still runs after `_HANG_S` (then it is killed)."""
    end = time.monotonic() + _HANG_S
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_a_child_forked_while_a_warning_is_shown_can_note_a_config() -> None:
    config = CheckpointManager.Config.with_sync_save()
    config.save.writer_config.checkpoint_write_barrier_timeout_sec = 5  # warned about at the next build
    showing, release = threading.Event(), threading.Event()

    def show(*_args: Any, **_kwargs: Any) -> None:
        showing.set()
        release.wait(_HANG_S)

    built: list[CheckpointManager] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        builder = threading.Thread(target=lambda: built.append(CheckpointManager(config)))
        builder.start()
        try:
            assert showing.wait(_HANG_S), "no warning was shown: the test proves nothing"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running
                pid = os.fork()
            if pid == 0:
                try:
                    notes_of(CheckpointManager.Config())["probe"] = True
                finally:
                    os._exit(0)
            status = _child_status(pid)
        finally:
            release.set()
            builder.join(_HANG_S)
    for manager in built:
        manager.close()
    assert status is not None, "the forked child hung on the notes' lock"
    assert os.waitstatus_to_exitcode(status) == 0
