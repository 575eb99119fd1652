"""A Future that a Ctrl-C on a waiting thread cannot wedge.

`concurrent.futures.Future` guards its state with a `threading.Condition`, whose `__enter__`, `__exit__` and
`wait` are Python frames. A KeyboardInterrupt (raised on the main thread, where a training script waits for its
saves) that lands in one of them just after the lock was taken leaves that lock held for good, or released
twice (`RuntimeError: cannot release un-acquired lock` instead of the KeyboardInterrupt). The engine thread that
later resolves the Future then waits for the lock forever, and every later save, queued on the same thread,
with it: under a storm of SIGINTs one run in three ended with every save refused after `wait_timeout_secs`.

`SettledFuture` stores its outcome once, in one attribute, under a C-level lock (a `with` on it runs no Python
frame), and its waiters wait on a second C-level lock that is released once the outcome is stored. An interrupt
while waiting is raised from inside the acquire, having taken nothing; one that lands after an acquire succeeded
leaks a lock that nobody needs any more, because every waiter reads the outcome first and waits in slices.
Done-callbacks are kept here as well. The stdlib state is still set, after the outcome, for
`concurrent.futures.wait()` and `as_completed()`, which read it under the Condition; the thread resolving the
Future waits for that lock a bounded time only, so a lock an interrupt left held costs those two callers (they
do not see the Future done) and never the engine thread behind it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

from torch_checkpointing.errors import log_safely

__all__ = ["SettledFuture"]

logger = logging.getLogger("torch_checkpointing")
T = TypeVar("T")
_STDLIB_WAIT_S = 1.0  # the Condition is held for microseconds by a live holder
_SLICE_S = 0.1  # a waiter whose wake-up was taken by an interrupted waiter sees the outcome within a slice


class SettledFuture(Future[T]):
    """A `concurrent.futures.Future` for work that starts when the Future is made (it is never cancelled)."""

    def __init__(self) -> None:
        super().__init__()
        self._outcome: tuple[Any, BaseException | None] | None = None
        self._store = threading.Lock()
        self._settled = threading.Lock()
        self._settled.acquire()
        self._callbacks: list[Callable[[Future[T]], object]] = []

    def __repr__(self) -> str:  # the stdlib one takes the Condition: it blocked behind a lock left held
        outcome = self._outcome
        if outcome is None:
            state = "running"
        elif outcome[1] is None:
            state = f"finished returned {type(outcome[0]).__name__}"
        else:
            state = f"finished raised {type(outcome[1]).__name__}"
        return f"<{type(self).__name__} at {id(self):#x} state={state}>"

    def set_result(self, result: T) -> None:
        self._settle((result, None))

    def set_exception(self, exception: BaseException | None) -> None:
        if exception is None:
            raise TypeError("set_exception() needs an exception; use set_result() for a success")
        self._settle((None, exception))

    def try_set_exception(self, exception: BaseException) -> bool:
        """`set_exception` unless the Future has its outcome already; whether this call gave it."""
        return self._settle((None, exception), first_only=True)

    def _settle(self, outcome: tuple[Any, BaseException | None], first_only: bool = False) -> bool:
        with self._store:
            if self._outcome is not None:
                if first_only:
                    return False
                raise InvalidStateError(f"{self!r} already has its outcome")
            self._outcome = outcome
            callbacks, self._callbacks = self._callbacks, []
        self._settled.release()
        self._settle_stdlib(outcome)
        for fn in callbacks:
            self._call(fn)
        return True

    def _settle_stdlib(self, outcome: tuple[Any, BaseException | None]) -> None:
        """The stdlib state, for `concurrent.futures.wait()`/`as_completed()`; bounded, so that a Condition lock
        an interrupt left held on another thread costs those two callers, never the thread resolving this."""
        if not self._condition.acquire(timeout=_STDLIB_WAIT_S):
            log_safely(
                logger,
                logging.WARNING,
                "%r: its Condition lock is held (an interrupted waiter left it); concurrent.futures.wait() "
                "will not see it done, result() and done() do",
                self,
            )
            return
        try:  # the Condition's lock is an RLock: the stdlib setter takes it again
            result, error = outcome
            if error is None:
                super().set_result(result)
            else:
                super().set_exception(error)
        finally:
            self._condition.release()

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        with self._store:
            if self._outcome is None:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _call(self, fn: Callable[[Future[T]], object]) -> None:
        try:
            fn(self)
        except Exception:
            log_safely(logger, logging.ERROR, "A done-callback of %r raised; ignored", self, exc_info=True)

    def done(self) -> bool:
        return self._outcome is not None

    def running(self) -> bool:
        return self._outcome is None

    def cancel(self) -> bool:
        return False  # the work started with the Future

    def cancelled(self) -> bool:
        return False

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> T:
        result, error = self._wait(timeout)
        if error is not None:
            raise error
        return result  # type: ignore[no-any-return]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._wait(timeout)[1]

    def _wait(self, timeout: float | None) -> tuple[Any, BaseException | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (outcome := self._outcome) is None:
            left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError()
            if self._settled.acquire(True, left):
                self._settled.release()
        return outcome
