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

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, Executor, Future, InvalidStateError
from typing import Any, ParamSpec, TypeVar

from torch_checkpointing.config import wait_seconds
from torch_checkpointing.errors import log_safely
from torch_checkpointing.signals import COPY_HELD, Held, signals_deferred, start_bounded

__all__ = ["SettledFuture", "WorkerPool", "settle_all"]

logger = logging.getLogger("torch_checkpointing")
T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")
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
        timeout = wait_seconds("timeout (of a Future's result() or exception())", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while (outcome := self._outcome) is None:
            left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError()
            if self._settled.acquire(True, left):
                self._settled.release()
        return outcome


_Job = tuple[SettledFuture[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class WorkerPool(Executor):
    """Up to `workers` daemon threads running submitted calls in submission order; `submit` gives a SettledFuture.

    The threads start at the first call (and at the first after it grew for `map_bounded`) and stay, so a
    process-wide pool starts each thread once (`Thread.start()` waits on an Event, one more Python-level lock on
    the caller's thread). Daemons: a check still running must not hold up interpreter exit after a Ctrl-C. A
    forked child starts its own threads (it inherits none).
    """

    def __init__(self, workers: int, name: str) -> None:
        self._workers = max(1, workers)
        self._name = name
        self._guard = threading.Lock()
        self._runners = 0  # map_bounded runners queued or running
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def _reserve(self, runners: int) -> None:
        """`runners` more calls that each keep a thread busy (`map_bounded`): the pool grows to all of them."""
        with self._guard:
            self._runners += runners
            self._workers = max(self._workers, self._runners)

    def _unreserve(self) -> None:
        with self._guard:
            self._runners -= 1

    def map_bounded(
        self, fn: Callable[[T], R], items: Sequence[T], concurrency: int, held: Held | None = None
    ) -> list[R]:
        """`[fn(x) for x in items]` on at most `concurrency` of the pool's threads at once; once every call has stopped,
        the first error is raised (calls not started after an error are skipped).

        The pool grows to the runners of every call at once, so concurrent callers do not queue behind each other.
        `held`: what a WARNING says of a signal held while the running calls end after a Ctrl-C (calls that may
        take long, such as a file's write); None holds it in silence.
        """
        workers = max(1, min(concurrency, len(items)))
        if workers == 1:
            return [fn(x) for x in items]
        todo = iter(enumerate(items))  # shared by the runners; an iterator's next() here is atomic
        results: list[Any] = [None] * len(items)
        failed: list[BaseException] = []

        def runner() -> None:
            try:
                for i, x in todo:
                    if failed:
                        return
                    try:
                        results[i] = fn(x)
                    except BaseException as exc:
                        failed.append(exc)
                        raise
            finally:
                self._unreserve()

        self._reserve(workers)
        futures = [self.submit(runner) for _ in range(workers)]
        try:
            settle_all(futures)
        except BaseException as exc:  # a Ctrl-C while waiting: no new call starts, and the running ones end before
            failed.append(exc)  # the caller cleans up after them (a sync save removes the files they write)
            # A second Ctrl-C here returned while they still wrote: the save removed its files under them. Its
            # handler runs once they have ended; the same signal once more stops the wait at once.
            what = f"{self._name}: waiting for its running calls to end"
            with signals_deferred(what, quiet=held is None, held=held or COPY_HELD):
                settle_all(futures)
            raise
        if failed:
            raise failed[0]  # the first to fail, in time
        return results

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> SettledFuture[T]:
        future: SettledFuture[T] = SettledFuture()
        with self._guard:
            if self._pid != os.getpid():
                self._reset()
            if self._closed:
                raise RuntimeError(f"{self._name}: cannot schedule work after shutdown()")
            if len(self._threads) < self._workers:  # all at the first call: a process-wide pool keeps them
                with signals_deferred(f"{self._name}: starting its threads", quiet=True):
                    self._start_threads()
            # Queued once its threads run: a call whose thread the OS refused ran later, at the next call that
            # started one (a load's check of a file long since given up on).
            self._jobs.put((future, fn, args, kwargs))
        return future

    def _start_threads(self) -> None:
        """(Holding the guard, signals deferred: an interrupt between registering a thread and starting it left
        the pool counting a thread that never ran, and its jobs waited for good.)"""
        for i in range(len(self._threads), self._workers):
            thread = self._thread(i)
            start_bounded(thread)  # refused: a MemoryError naming it (the threads started stay)
            self._threads.append(thread)

    def _thread(self, i: int) -> threading.Thread:
        return threading.Thread(target=_work, args=(self._jobs,), name=f"{self._name}_{i}", daemon=True)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the threads once the queued calls ran (or, with `cancel_futures`, failed with CancelledError)."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            _cancel_queued(self._jobs)
        for _ in threads:
            self._jobs.put(None)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


def _work(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        _run(*job)
        del job  # nothing of a finished call is kept alive while the thread waits for the next


def _run(future: SettledFuture[Any], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # the caller gets it from the Future, as from an executor's
        future.set_exception(exc)
    else:
        future.set_result(result)


def _cancel_queued(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return
        if job is not None:
            job[0].set_exception(CancelledError())


def settle_all(futures: Iterable[Future[Any]]) -> None:
    """Wait until every Future has its outcome (the outcomes are the caller's to read).

    For a SettledFuture this takes no Python-level lock; `concurrent.futures.wait()` takes each Future's Condition.
    """
    for future in futures:
        with contextlib.suppress(CancelledError):  # a stdlib Future's exception() raises it
            future.exception()
