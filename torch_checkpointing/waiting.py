"""Waiting for another thread without a Python-level lock a Ctrl-C could wedge.

Python runs a signal handler between two bytecodes of the main thread, so its KeyboardInterrupt can land in any
Python frame. `threading.Condition` and `threading.Event` take and give back their lock in Python frames
(`Condition.__enter__`, `wait`, `Event.set`): an interrupt landing there leaves the lock held by the interrupted
thread, and the thread that would notify it then blocks forever in `notify_all()` or `set()` (a save() or load()
on another thread waited for the manager's call registry for good, and so did close()); or it gives the lock back
twice, and the KeyboardInterrupt comes out as `RuntimeError: cannot release un-acquired lock`.

Here the critical sections use a C-level lock as their `with` target (its acquire and release are one C call
each, and the `with` releases it on any exit), and a waiter sleeps outside it on a C-level lock of its own,
which the notifier releases. A Ctrl-C while sleeping is raised from inside that acquire, having taken nothing;
a notification an interrupt skipped is caught up by the next re-check, at most `RECHECK_S` later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from torch_checkpointing.config import wait_seconds

__all__ = ["RECHECK_S", "Deadline", "Flag", "Wakeups"]

RECHECK_S = 0.1


class Deadline:
    """One timeout shared by waits made one after another, each given what is left of it: a loop that gave each
    wait the whole timeout waited up to N times it (`concurrent.futures.wait` and `Future.result` bound the
    whole wait). Takes a timeout `wait_seconds` has read; None: no limit."""

    def __init__(self, timeout: float | None) -> None:
        self._at = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        """The seconds left (0 once passed: a wait then only looks), None for no limit."""
        return None if self._at is None else max(0.0, self._at - time.monotonic())


class Wakeups:
    """The waiters of one mutex-guarded state: `wait_for` sleeps until `notify_all()` or a re-check finds it ready.

    Call order: the state changes and `notify_all()` runs with the mutex held; `wait_for` is called without it.
    """

    def __init__(self) -> None:
        self._waiters: list[threading.Lock] = []

    def wait_for(self, mutex: AbstractContextManager[object], ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until `ready()` (called holding `mutex`) is true, or `timeout` seconds (None: no limit); whether
        it became true. `ready()` returning True ends the wait with the mutex released: a caller that must act on
        the state atomically does so inside `ready()`."""
        timeout = wait_seconds("timeout (of a lock's hold or a flag's wait)", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter: threading.Lock | None = None
        try:
            while True:
                with mutex:
                    self._discard(waiter)  # its slice ran out unnotified
                    if ready():
                        return True
                    waiter = self._add()
                if not _sleep(waiter, deadline):
                    return False
        finally:
            if waiter is not None:
                with mutex:
                    self._discard(waiter)  # a timeout or an interrupt: nobody will wake it

    def notify_all(self) -> None:
        """(Holding the mutex.) Wake every waiter to re-check."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.release()

    def _add(self) -> threading.Lock:
        waiter = threading.Lock()
        waiter.acquire()
        self._waiters.append(waiter)
        return waiter

    def _discard(self, waiter: threading.Lock | None) -> None:
        if waiter is not None and waiter in self._waiters:
            self._waiters.remove(waiter)


def _sleep(waiter: threading.Lock, deadline: float | None) -> bool:
    """Sleep until `waiter` is released or one `RECHECK_S` slice ends; False once the deadline has passed."""
    left = RECHECK_S if deadline is None else min(RECHECK_S, deadline - time.monotonic())
    if left <= 0:
        return False
    waiter.acquire(True, left)
    return True


class Flag:
    """`threading.Event`'s `set`/`clear`/`is_set`/`wait`, safe against an interrupt in any of them."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._set = False
        self._wakeups = Wakeups()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._mutex:
            self._set = True
            self._wakeups.notify_all()

    def clear(self) -> None:
        self._set = False

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the flag is set, waiting up to `timeout` seconds (None: no limit) for it."""
        return self._wakeups.wait_for(self._mutex, self.is_set, timeout)
