"""A reader/writer lock whose write side may be released by another thread.

The staging copy holds the write side (taken by `save()` on the caller's thread, released by the staging
thread when the copy is done); `CheckpointManager.lock()` takes the read side around optimizer steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

__all__ = ["DEFAULT_ACQUIRE_TIMEOUT_SECS", "RWLock", "RWLockMode"]

DEFAULT_ACQUIRE_TIMEOUT_SECS = 600.0


class RWLockMode(Enum):
    READ = "read"
    WRITE = "write"


class RWLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    def acquire(self, mode: RWLockMode, timeout: float | None = DEFAULT_ACQUIRE_TIMEOUT_SECS) -> None:
        with self._cond:
            if mode is RWLockMode.READ:
                ok = self._cond.wait_for(lambda: not self._writer, timeout)
            else:
                ok = self._cond.wait_for(lambda: not self._writer and self._readers == 0, timeout)
            if not ok:
                # RuntimeError, not a CheckpointError: the type recorded in API_SURFACE §10, which callers catch
                raise RuntimeError(
                    f"Failed to acquire the checkpoint {mode.value} lock after {timeout} seconds; this is likely a "
                    f"deadlock (a save() inside lock(), or a staging copy that never finished)."
                )
            if mode is RWLockMode.READ:
                self._readers += 1
            else:
                self._writer = True

    def release(self, mode: RWLockMode) -> None:
        with self._cond:
            if mode is RWLockMode.READ:
                self._readers -= 1
            else:
                self._writer = False
            self._cond.notify_all()

    @contextmanager
    def hold(self, mode: RWLockMode, timeout: float | None = DEFAULT_ACQUIRE_TIMEOUT_SECS) -> Iterator[None]:
        self.acquire(mode, timeout)
        try:
            yield
        finally:
            self.release(mode)
