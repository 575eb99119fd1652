"""A thread whose start was given up on runs nothing (round 30).

`signals.start_bounded` waits a bounded time for a new thread to say it runs, and past it tells its caller the
thread died in its own start-up (a `MemoryError`: what RLIMIT_AS does to a thread's first allocation). A thread
merely slow to be scheduled (a process stopped with SIGSTOP and continued, a machine swapping) then ran its target
anyway: a save's or a pool's thread the caller was told never started took its jobs beside the one started in its
place. Here the new thread's start-up is held at its first step until its caller has given up.
"""

from __future__ import annotations

import threading

import pytest

from torch_checkpointing import futures, signals


class _SlowStarting(threading.Thread):
    """A thread held in its start-up (the step before it says it runs) until `gate` is set."""

    gate = threading.Event()

    def _set_tstate_lock(self) -> None:
        assert self.gate.wait(120), "the test never let the thread go on"
        super()._set_tstate_lock()  # type: ignore[misc]


def _given_up_on(thread: threading.Thread, start: object) -> None:
    """`start(thread)` gives up with a MemoryError naming the thread; then the thread goes on and ends."""
    with pytest.raises(MemoryError, match=thread.name):
        start(thread)  # type: ignore[operator]
    _SlowStarting.gate.set()
    assert thread._started.wait(120)  # type: ignore[attr-defined]
    thread.join(120)
    assert not thread.is_alive()


@pytest.fixture(autouse=True)
def _short_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signals, "_THREAD_START_S", 0.5)  # the bound, shortened; the thread is held far longer
    _SlowStarting.gate = threading.Event()


@pytest.mark.parametrize("start", [signals.start_bounded, signals.start_thread], ids=["bounded", "start_thread"])
def test_a_thread_given_up_on_runs_nothing_when_it_starts_late(start: object) -> None:
    """Defect: the target ran once the thread went on: `ran == ['ran']`, after the caller's MemoryError."""
    ran: list[str] = []
    _given_up_on(_SlowStarting(target=ran.append, args=("ran",), name="t-slow", daemon=True), start)
    assert ran == []


def test_a_pool_thread_given_up_on_takes_no_place_among_its_threads() -> None:
    """A pool's thread given up on does not wait on the pool's jobs once it starts: the pool's own count of its
    threads is all there is, and its shutdown (one stop per counted thread) ends them all.

    Defect: the late thread ran `_work` and waited on the pool's queue for good (alive after `join(30)`), where it
    could take the stop meant for a counted thread and leave `shutdown(wait=True)` waiting for ever."""
    pool = futures.WorkerPool(1, "t-pool")
    late: list[threading.Thread] = []

    def thread(i: int) -> threading.Thread:
        late.append(_SlowStarting(target=futures._work, args=(pool._jobs,), name=f"t-pool_{i}", daemon=True))
        return late[-1]

    pool._thread = thread  # type: ignore[method-assign]
    with pytest.raises(MemoryError, match="t-pool_0"):
        pool.submit(print, "never")
    _SlowStarting.gate.set()
    assert late[0]._started.wait(120)  # type: ignore[attr-defined]
    late[0].join(30)  # a thread that runs nothing ends at once
    assert not late[0].is_alive()
    assert pool.submit(len, "ran").result(timeout=120) == 3  # the next call starts the pool's thread
    pool.shutdown(wait=True)
