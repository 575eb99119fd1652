"""A thread that dies before it runs is a shortage, not a hang (round 29).

Under a low address-space limit (RLIMIT_AS) a new thread can be created by the OS and then die of MemoryError in
its own start-up, before it tells `Thread.start()` that it runs (CPython prints "Exception ignored in thread
started by: ... MemoryError"). `Thread.start()` waits for that word without a bound: a sync save to S3 under
the limit hung in a multipart part thread's start (1 run in 4 of a stepped-limit save, stack ending in
futures.py `_start_threads` -> threading.py `start` -> `wait`). Here the start-up's death is made to happen at
that exact point (the step that allocates the thread's own lock), in a thread started by each of the engine's
two ways to start one; the OS thread is real and really ends.
"""

from __future__ import annotations

import subprocess
import sys

from tests.probes import REPO

_DIES_STARTING = r"""
import sys, threading
from torch_checkpointing import futures, signals
signals._THREAD_START_S = 2.0  # the bound, shortened: a thread that runs says so in microseconds

class DiesStarting(threading.Thread):
    def _set_tstate_lock(self):  # the first allocation of the new thread's start-up, as RLIMIT_AS refuses it
        raise MemoryError

def started_by(how):
    try:
        if how == "start_thread":
            signals.start_thread(DiesStarting(target=print, name="t-dies"))
        else:
            pool = futures.WorkerPool(1, "t-pool")
            pool._thread = lambda i: DiesStarting(target=print, name=f"t-pool_{i}")
            pool.submit(print, "ran")
    except MemoryError as exc:
        return f"MemoryError {'ulimit -v' in str(exc) and 't-' in str(exc)}"
    return "started"

print(started_by(sys.argv[1]), flush=True)
"""


def _start(how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _DIES_STARTING, how], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_a_thread_that_dies_starting_is_a_memory_error_naming_it_and_the_fix() -> None:
    for how in ("start_thread", "pool"):
        try:
            done = _start(how)
        except subprocess.TimeoutExpired:  # before: Thread.start() waited for good
            raise AssertionError(f"{how}: the start of a thread that died starting never returned") from None
        assert done.stdout.strip() == "MemoryError True", (how, done.stdout, done.stderr[-2000:])
