"""A signal that lands in a load's copy phase waits for the copy to finish.

Python runs a signal handler on the main thread between two bytecodes, so a Ctrl-C (KeyboardInterrupt) or a
preemption handler's exception (SystemExit on SIGTERM) could land between two `copy_()`s of a load and leave
the templates half restored, the state `load()` promises never to leave (a SIGINT storm over loads left 14-17
such loads per 6 s). While the copy runs, a signal with a Python handler is recorded and its handler runs once
the copy has ended: the templates hold the whole checkpoint, then the handler raises as it would have. The same
signal a second time runs its handler at once, the way out of a copy that does not end (a custom resharder that
hangs), and a WARNING says the templates may then be partly restored.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch_checkpointing.errors import log_safely

__all__ = ["WATCHED_SIGNALS", "signals_deferred", "start_thread"]

logger = logging.getLogger("torch_checkpointing")

# Ctrl-C, and what schedulers send to preempt a job (and jobs install handlers for).
WATCHED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)

Handler = Callable[[int, Any], Any]


@contextmanager
def signals_deferred(what: str, *, quiet: bool = False) -> Iterator[None]:
    """Run the Python handlers of signals that arrive inside the block after it (see the module docstring).

    Only the main thread runs signal handlers; elsewhere, and for SIG_IGN/SIG_DFL, nothing changes. `quiet`:
    no WARNING for a block of a few milliseconds (starting a thread), where the signal is only postponed.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Handler] = {n: h for n in WATCHED_SIGNALS if callable(h := signal.getsignal(n))}
    pending: list[int] = []
    closed = [False]

    def finish() -> None:  # the handlers put back, then the recorded signals sent to them
        for signum, handler in previous.items():
            if signal.getsignal(signum) is deferred:
                signal.signal(signum, handler)
        sent = pending.copy()
        pending.clear()
        _deliver(sent)

    def deferred(signum: int, frame: Any) -> None:
        handler = previous[signum]
        if closed[0]:  # the block has ended and this signal interrupted finish(): finish it, then run the handler
            finish()
            handler(signum, frame)
        elif signum in pending:
            if not quiet:
                _warn("%s: %s again: its handler runs now, and the templates may be partly restored", what, signum)
            handler(signum, frame)
        else:
            pending.append(signum)
            if not quiet:
                _warn(
                    "%s: %s during the copy into the templates; its handler runs once the copy has finished (send "
                    "it again to run it now, leaving the templates partly restored)",
                    what,
                    signum,
                )

    try:
        for signum in previous:  # inside the try: an interrupt between two leaves none of them replaced
            signal.signal(signum, deferred)
        yield
    finally:
        closed[0] = True
        finish()


def start_thread(thread: threading.Thread) -> None:
    """`thread.start()`, with the signals deferred until it has returned.

    `Thread.start()` waits on an Event for the new thread to say it runs; a KeyboardInterrupt landing in that
    wait left the Event's lock held, and the new thread blocked for good before running anything (a worker
    pool's thread never took a job). A signal that arrives meanwhile runs its handler once the thread runs.
    """
    with signals_deferred(f"starting thread {thread.name}", quiet=True):
        thread.start()


def _deliver(pending: list[int]) -> None:
    """Send the recorded signals again, now to the handlers restored: each runs as it would have. They arrive
    together (held by the mask until all are sent), so that Python runs their handlers in one pass, and one that
    raises leaves the others tripped, handled at the next bytecode, not lost."""
    if not pending:
        return
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - POSIX has it
        for signum in pending:
            signal.raise_signal(signum)
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, pending)
    try:
        for signum in pending:
            signal.raise_signal(signum)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _warn(message: str, what: str, signum: int) -> None:
    log_safely(logger, logging.WARNING, message, what, _name(signum))


def _name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
