"""Ctrl-C, SIGTERM, SIGHUP and SIGQUIT held over a step that must not be cut in the middle, then delivered.

Two such steps: importing torch (seconds of C++ that a Python exception cannot cross) and spawning the ranks (a
KeyboardInterrupt inside `start_processes` left a rank half started: it read its start-up data from a pipe its
parent had closed and printed a multiprocessing traceback under the simulator's one-line "interrupted").

A handler set by the step itself replaces the hold: torch's elastic `start_processes` sets its own for SIGINT
and SIGTERM (raising its SignalException) on the main thread, so the spawn is made on a thread of its own
(`off_the_main_thread`), where no handler runs and none is set.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["STOPPING", "Held", "StepTimedOut", "exit_on_a_late_stop", "off_the_main_thread", "signals_held"]

T = TypeVar("T")

# The signals that stop a run: Ctrl-C, `kill`/`timeout`, the terminal closed, Ctrl-\\.
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class StepTimedOut(TimeoutError):
    """`off_the_main_thread`'s step ran past its time; `thread` runs it still (a daemon thread)."""

    def __init__(self, timeout_s: float, thread: threading.Thread) -> None:
        super().__init__(f"the step did not finish within {timeout_s:g}s")
        self.thread = thread


@dataclass
class Held:
    """The signals that arrived while they were held; `deliver()` runs the first one's restored handler."""

    signals: list[int] = field(default_factory=list)

    def deliver(self) -> None:
        for signum in self.signals[:1]:
            signal.raise_signal(signum)  # KeyboardInterrupt, or the SIGTERM handler in force


@contextmanager
def signals_held() -> Iterator[Held]:
    """Hold SIGINT, SIGTERM, SIGHUP and SIGQUIT inside the block; the caller delivers them (`Held.deliver`) where
    it can act on them. Not for a signal the shell ignores (`cmd &`), nor off the main thread, where handlers
    cannot be set."""
    held = Held()
    holding = [
        signum
        for signum in STOPPING
        if threading.current_thread() is threading.main_thread()
        and signal.getsignal(signum) not in (signal.SIG_IGN, None)
    ]
    previous = {signum: signal.signal(signum, lambda signum, _frame: held.signals.append(signum)) for signum in holding}
    try:
        yield held
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def off_the_main_thread(step: Callable[[], T], timeout_s: float) -> T:
    """`step()`, made on a thread of its own while this one waits for it, at most `timeout_s` seconds (then a
    `StepTimedOut`, which holds the step's thread); its exception is raised here.

    Python runs signal handlers on the main thread only. Made there, inside `signals_held`, the ranks' spawn was
    still cut: torch's `start_processes` set its own SIGINT handler over the hold, a Ctrl-C raised its
    SignalException after rank 0 had started, and that rank, which the launcher had no handle on, was never
    stopped (it printed a multiprocessing traceback once the simulator had exited). On another thread the step
    is never interrupted, and torch sets no handler (it does so on the main thread only).

    The wait is bounded: a spawn blocks until each rank reads what it is handed, and a rank stuck before that
    (its interpreter's startup hung) held the launch past its timeout, signals held, for as long as it stayed
    stuck."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, step()))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="simulator-step", daemon=True)
    thread.start()
    thread.join(timeout_s)  # a held signal's handler runs meanwhile and returns; the wait goes on
    if not outcome:
        raise StepTimedOut(timeout_s, thread)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def exit_on_a_late_stop(code: int, *, over: Collection[object] = ()) -> None:
    """From here on, a stopping signal ends the process at once with the run's own exit `code`.

    Called once the report and its verdict are out: what follows (removing the run directory, the interpreter's
    exit with torch's teardown) is no part of the run. A SIGTERM there killed the process by its default action
    (no line, no verdict's code), a Ctrl-C raised a KeyboardInterrupt in the exit. Only a signal at its default
    or at one of the handlers `over` (the caller's own) is taken; not one the shell ignores, nor off the main
    thread. The package CLI's entry point (`torch_checkpointing.__main__`) does the same for its commands; the
    simulator reaches a backend through its public API only, so it keeps its own.
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def finish(_signum: int, _frame: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: its loss was reported when lost
                stream.flush()
        os._exit(code)

    ours = (signal.default_int_handler, signal.SIG_DFL, *over)
    taken = [signum for signum in STOPPING if any(signal.getsignal(signum) is h for h in ours)]
    for signum in taken:
        signal.signal(signum, finish)
    atexit.register(_ignore, taken)


def _ignore(signums: list[signal.Signals]) -> None:
    """Ignore `signums` for the rest of the interpreter's exit: its finalization puts every Python handler back
    to the default action before torch's teardown, where a SIGTERM still killed the process."""
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)
