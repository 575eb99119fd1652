"""A reader/writer lock whose write side may be released by another thread.

The staging copy holds the write side (taken by `save()` on the caller's thread, released by the staging
thread when the copy is done); `CheckpointManager.lock()` takes the read side around optimizer steps.
The lock knows which threads hold its read side: a thread asking for the write side while it holds the read
side (a `save()` inside `with manager.lock():`) would wait for itself, so it is refused at once.

A waiting writer goes before new readers: a training thread taking `lock()` back to back (one optimizer step
after the other) otherwise kept the read side held, or retaken within microseconds, so that a `save()` on another
thread never found it free and failed as a deadlock after `wait_timeout_secs`. A thread that already holds the
read side still gets it again (a nested `lock()`): making it wait for the writer would wait for itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

from torch_checkpointing.errors import CheckpointError

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
        self._read_holds: dict[int, int] = {}  # thread ident -> read holds it has not released
        self._writers_waiting = 0

    def held_by_this_thread(self) -> bool:
        """Whether the calling thread holds the read side (it is inside `with manager.lock():`)."""
        with self._cond:
            return self._read_holds.get(threading.get_ident(), 0) > 0

    def acquire(self, mode: RWLockMode, timeout: float | None = DEFAULT_ACQUIRE_TIMEOUT_SECS) -> None:
        with self._cond:
            if mode is RWLockMode.WRITE and self._read_holds.get(threading.get_ident(), 0) > 0:
                raise CheckpointError(
                    "The checkpoint write lock was asked for by a thread that holds its read side: a save() inside "
                    "`with manager.lock():` would wait for itself. Call save() after the with block."
                )
            ok = self._wait_read(timeout) if mode is RWLockMode.READ else self._wait_write(timeout)
            if not ok:
                # RuntimeError, not a CheckpointError: the type recorded in API_SURFACE §10, which callers catch
                raise RuntimeError(
                    f"Failed to acquire the checkpoint {mode.value} lock after {timeout} seconds; this is likely a "
                    f"deadlock (a staging copy that never finished, or a lock() another thread never released)."
                )
            if mode is RWLockMode.READ:
                self._readers += 1
                me = threading.get_ident()
                self._read_holds[me] = self._read_holds.get(me, 0) + 1
            else:
                self._writer = True

    def _wait_read(self, timeout: float | None) -> bool:
        """(Holding `_cond`.) Behind a waiting writer, unless this thread holds the read side already."""
        nested = self._read_holds.get(threading.get_ident(), 0) > 0
        return self._cond.wait_for(lambda: not self._writer and (nested or not self._writers_waiting), timeout)

    def _wait_write(self, timeout: float | None) -> bool:
        """(Holding `_cond`.) Counted as waiting meanwhile, so that new readers queue behind this writer."""
        self._writers_waiting += 1
        try:
            return self._cond.wait_for(lambda: not self._writer and self._readers == 0, timeout)
        finally:
            self._writers_waiting -= 1
            self._cond.notify_all()  # readers held back by this writer re-check, whether it got the lock or gave up

    def release(self, mode: RWLockMode) -> None:
        with self._cond:
            if mode is RWLockMode.READ:
                self._readers -= 1
                self._forget_read_hold(threading.get_ident())
            else:
                self._writer = False
            self._cond.notify_all()

    def _forget_read_hold(self, me: int) -> None:
        held = self._read_holds.get(me, 0)
        if held > 1:
            self._read_holds[me] = held - 1
        else:  # a read side released by another thread than took it leaves nothing to forget here
            self._read_holds.pop(me, None)

    @contextmanager
    def hold(self, mode: RWLockMode, timeout: float | None = DEFAULT_ACQUIRE_TIMEOUT_SECS) -> Iterator[None]:
        self.acquire(mode, timeout)
        try:
            yield
        finally:
            self.release(mode)
