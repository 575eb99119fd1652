"""`WorkerPool` and its `map_bounded`: the executor for work a Ctrl-C-able thread waits for (see `futures`)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import CancelledError

import pytest

from tests.probes import fresh_fork_statuses
from torch_checkpointing.futures import SettledFuture, WorkerPool


def test_submit_gives_settled_futures_with_results_and_errors_in_order() -> None:
    pool = WorkerPool(1, "t-order")
    seen: list[int] = []
    futures = [pool.submit(seen.append, i) for i in range(20)]
    failing = pool.submit(int, "not a number")
    assert all(isinstance(f, SettledFuture) for f in futures)
    assert [f.result(5) for f in futures] == [None] * 20
    assert seen == list(range(20))  # one thread: submission order
    with pytest.raises(ValueError, match="not a number"):
        failing.result(5)
    pool.shutdown()


def test_a_condition_lock_left_held_by_a_waiter_does_not_stop_the_worker() -> None:
    # What a Ctrl-C inside Condition.__enter__ leaves on the waiting thread: with an executor's stdlib Future the
    # worker would wait for that lock in set_result forever, and every call queued behind it with it.
    pool = WorkerPool(1, "t-leak")
    go = threading.Event()
    first = pool.submit(go.wait, 5)
    first._condition.acquire()
    try:
        second = pool.submit(lambda: "ran")
        go.set()
        assert first.result(10) is True
        assert second.result(10) == "ran"
    finally:
        first._condition.release()
        pool.shutdown()


def test_shutdown_with_cancel_futures_fails_the_queued_calls() -> None:
    pool = WorkerPool(1, "t-cancel")
    go, started = threading.Event(), threading.Event()

    def run() -> bool:
        started.set()
        return go.wait(60)

    running = pool.submit(run)
    assert started.wait(30)  # running, not queued: cancel_futures fails only the calls not started
    queued = [pool.submit(lambda: "ran") for _ in range(3)]
    stopper = threading.Thread(target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True})
    stopper.start()
    for future in queued:  # failed while the running call still runs
        assert isinstance(future.exception(30), CancelledError)
    assert stopper.is_alive()  # shutdown(wait=True) waits for it
    go.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert running.result(5) is True
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_a_forked_child_runs_calls_on_its_own_threads() -> None:
    # Forked from a new interpreter (`fresh_fork_statuses`), never from this test process: a child of a test
    # process inherits every earlier test's threads and garbage.
    (status,) = fresh_fork_statuses(
        """
        from torch_checkpointing.futures import WorkerPool
        pool = WorkerPool(2, "t-fork")
        assert pool.submit(lambda: 1).result(5) == 1  # the parent's threads exist; a child inherits none
        def child():
            return pool.submit(lambda: 2).result(5) == 2
        """,
        ["child()"],
    )
    assert status == 0, status


def test_map_bounded_keeps_order_and_its_concurrency_bound() -> None:
    pool = WorkerPool(1, "t-map")
    lock = threading.Lock()
    running = [0, 0]  # now, most
    first_three = threading.Barrier(3, timeout=30)  # they run at once, whenever the threads get to run

    def work(x: int) -> int:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        if x < 3:
            first_three.wait()
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return x * x

    assert pool.map_bounded(work, list(range(24)), 3) == [x * x for x in range(24)]
    assert running[1] == 3  # grown to 3 threads, never more at once


def test_map_bounded_raises_the_first_error_once_every_call_stopped() -> None:
    pool = WorkerPool(1, "t-map-error")
    finished: list[int] = []

    def work(x: int) -> int:
        if x == 2:
            raise OSError(f"item {x}")
        time.sleep(0.05)
        finished.append(x)
        return x

    with pytest.raises(OSError, match="item 2"):
        pool.map_bounded(work, [0, 1, 2, 3, 4, 5, 6, 7], 2)
    count = len(finished)
    time.sleep(0.2)
    assert len(finished) == count  # nothing ran after the call returned
    assert count < 7  # the calls not started after the error were skipped


def test_concurrent_map_bounded_calls_each_get_their_concurrency() -> None:
    # Two callers of concurrency 2 on one pool: all four calls must run at once (a barrier of 4), which they can
    # only if the pool grew to both callers' runners instead of queueing one behind the other.
    pool = WorkerPool(1, "t-map-grow")
    barrier = threading.Barrier(4, timeout=10)
    results: list[list[int]] = []

    def caller() -> None:
        results.append(pool.map_bounded(lambda x: barrier.wait() * 0 + x, [1, 2], 2))

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == [[1, 2], [1, 2]]


def test_an_interrupted_map_bounded_starts_nothing_more_and_returns_once_its_calls_ended() -> None:
    # A sync save's file writes: after a Ctrl-C the caller removes what they write, so none may still run then.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    pool = WorkerPool(1, "t-map-interrupt")
    running, started = [0], [0]
    lock = threading.Lock()

    def work(x: int) -> int:
        with lock:
            running[0] += 1
            started[0] += 1
            if started[0] == 2:  # both calls run: Ctrl-C, handled on the caller's thread while they go on
                os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        with lock:
            running[0] -= 1
        return x

    try:
        with pytest.raises(KeyboardInterrupt):
            pool.map_bounded(work, list(range(8)), 2)
        assert running[0] == 0  # the calls running at the interrupt had ended
        assert started[0] == 2  # and none started after it
    finally:
        signal.signal(signal.SIGINT, before)
