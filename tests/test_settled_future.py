"""`SettledFuture` (and so every save's `WriteFuture`): a Future whose resolution never waits for a lock that
an interrupted waiter may have left held, and that still behaves as a `concurrent.futures.Future` for user code
(`result`, `exception`, `done`, callbacks, `concurrent.futures.wait`, `asyncio.wrap_future`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from torch_checkpointing.checkpoint_saver import WriteFuture
from torch_checkpointing.futures import SettledFuture


def _in_thread(fn: object) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_a_condition_lock_left_held_by_a_waiter_does_not_stop_the_resolving_thread() -> None:
    """What a KeyboardInterrupt inside `Condition.__enter__` leaves: the Future's lock held by the waiting (main)
    thread. The engine thread resolving the Future must finish, and the outcome be readable, regardless."""
    future = WriteFuture("ck")
    future._condition.acquire()  # the leak
    try:
        resolver = _in_thread(lambda: future.set_result(7))
        resolver.join(5)
        assert not resolver.is_alive(), "set_result() waited for the lock the interrupted waiter left held"
        assert future.done()
        assert future.result(0) == 7
    finally:
        future._condition.release()


def test_outcomes_timeouts_and_double_resolution() -> None:
    future: SettledFuture[int] = SettledFuture()
    assert not future.done() and future.running() and not future.cancel() and not future.cancelled()
    with pytest.raises(TimeoutError):
        future.result(0)
    with pytest.raises(TimeoutError):
        future.exception(0.05)
    _in_thread(lambda: (time.sleep(0.05), future.set_result(3)))
    assert future.result(5) == 3 and future.exception() is None and future.done() and not future.running()
    with pytest.raises(concurrent.futures.InvalidStateError):
        future.set_result(4)
    assert not future.try_set_exception(ValueError("late"))
    assert future.result() == 3

    failed: SettledFuture[int] = SettledFuture()
    error = ValueError("boom")
    assert failed.try_set_exception(error)
    assert failed.exception() is error
    with pytest.raises(ValueError, match="boom"):
        failed.result()
    with pytest.raises(TypeError):
        SettledFuture().set_exception(None)


def test_done_callbacks_run_once_each_whenever_they_were_added(caplog: pytest.LogCaptureFixture) -> None:
    future: SettledFuture[str] = SettledFuture()
    seen: list[tuple[str, str]] = []
    future.add_done_callback(lambda f: seen.append(("before", f.result())))
    future.add_done_callback(lambda f: 1 / 0)  # logged, and the others still run
    future.set_result("x")
    future.add_done_callback(lambda f: seen.append(("after", f.result())))
    assert seen == [("before", "x"), ("after", "x")]
    assert any("done-callback" in r.getMessage() for r in caplog.records)


def test_stdlib_waiters_see_it_done() -> None:
    futures = [SettledFuture() for _ in range(3)]
    for i, f in enumerate(futures):
        _in_thread(lambda f=f, i=i: (time.sleep(0.02 * i), f.set_result(i)))
    done, pending = concurrent.futures.wait(futures, timeout=5)
    assert len(done) == 3 and not pending
    assert sorted(f.result() for f in concurrent.futures.as_completed(futures, timeout=5)) == [0, 1, 2]

    async def awaited() -> int:
        future: SettledFuture[int] = SettledFuture()
        _in_thread(lambda: (time.sleep(0.02), future.set_result(5)))
        return await asyncio.wrap_future(future)

    assert asyncio.run(awaited()) == 5


def test_a_waiter_interrupted_while_waiting_takes_nothing() -> None:
    """A waiter stopped in its wait (here by an exception from a timer signal, as Ctrl-C raises one) leaves the
    Future as it was: the resolving thread finishes and the next waiter gets the outcome."""
    import signal

    future: SettledFuture[int] = SettledFuture()

    class _Stop(Exception):
        pass

    def stop(signum: int, frame: object) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(_Stop):
            future.result(5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    resolver = _in_thread(lambda: future.set_result(1))
    resolver.join(5)
    assert not resolver.is_alive()
    assert future.result(1) == 1
