"""Ctrl-C and SIGTERM held over a step that must not be cut in the middle, then delivered.

Two such steps: importing torch (seconds of C++ that a Python exception cannot cross) and spawning the ranks (a
KeyboardInterrupt inside `start_processes` left a rank half started: it read its start-up data from a pipe its
parent had closed and printed a multiprocessing traceback under the simulator's one-line "interrupted").
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Held", "signals_held"]


@dataclass
class Held:
    """The signals that arrived while they were held; `deliver()` runs the first one's restored handler."""

    signals: list[int] = field(default_factory=list)

    def deliver(self) -> None:
        for signum in self.signals[:1]:
            signal.raise_signal(signum)  # KeyboardInterrupt, or the SIGTERM handler in force


@contextmanager
def signals_held() -> Iterator[Held]:
    """Hold SIGINT and SIGTERM inside the block; the caller delivers them (`Held.deliver`) where it can act on
    them. Not for a signal the shell ignores (`cmd &`), nor off the main thread, where handlers cannot be set."""
    held = Held()
    holding = [
        signum
        for signum in (signal.SIGINT, signal.SIGTERM)
        if threading.current_thread() is threading.main_thread()
        and signal.getsignal(signum) not in (signal.SIG_IGN, None)
    ]
    previous = {signum: signal.signal(signum, lambda signum, _frame: held.signals.append(signum)) for signum in holding}
    try:
        yield held
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
