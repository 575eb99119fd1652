"""A signal that lands in a load's copy phase waits for the copy to finish.

Python runs a signal handler on the main thread between two bytecodes, so a Ctrl-C (KeyboardInterrupt) or a
preemption handler's exception (SystemExit on SIGTERM) could land between two `copy_()`s of a load and leave
the templates half restored, the state `load()` promises never to leave (a SIGINT storm over loads left 14-17
such loads per 6 s). While the copy runs, a signal of `WATCHED_SIGNALS` with a Python handler is recorded and its
handler runs once the copy has ended: the templates hold the whole checkpoint, then the handler raises as it would
have. The same signal a second time runs its handler at once, the way out of a copy that does not end (a custom
resharder that hangs), and a WARNING says the templates may then be partly restored. "At once" is when Python
next runs: a block that waits in C++ (a gloo collective) runs no Python handler until that wait returns.
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch_checkpointing.errors import log_safely, raise_if_thread_not_started

__all__ = [
    "COPY_HELD",
    "WATCHED_SIGNALS",
    "Held",
    "handlers_replaced",
    "signal_name",
    "signals_deferred",
    "start_thread",
]

logger = logging.getLogger("torch_checkpointing")

# The rule: every signal that a person, a scheduler or a timer sends to stop or notify a program, whose Python
# handler may raise: Ctrl-C, preemption notices, a closed terminal, a user's timeout (SIGALRM: before, a handler
# raising TimeoutError between a file's create and its record left the file and its directory beside the id), the
# CPU-time limit's warning. Not the sampling profilers' timers (SIGPROF, SIGVTALRM): they fire many times a second,
# a held sample would be taken in the wrong frame and every second one would count as "sent again"; nor the
# notices that stop nothing (SIGCHLD, SIGWINCH), nor the synchronous faults.
_HELD_NAMES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2", "SIGXCPU")
WATCHED_SIGNALS = tuple(getattr(signal, name) for name in _HELD_NAMES if hasattr(signal, name))

Handler = Callable[[int, Any], Any]


@dataclass(frozen=True)
class Held:
    """What the WARNINGs of `signals_deferred` say of a held signal: held `during` the block, handled once
    `until` is true, or, sent again, as `again` says, and then `cut_short` holds. `again` says when Python runs
    the second one's handler: at once, unless the block waits in C++ (a gloo collective), where no Python handler
    runs until the wait returns."""

    during: str
    until: str
    cut_short: str
    again: str = "send it again to run it now"


COPY_HELD = Held("the copy into the templates", "the copy has finished", "the templates may be partly restored")


class handlers_replaced:  # used as a function: `with handlers_replaced(replacement):`
    """For the block, `replacement(signum, handler)` handles each watched signal that has a Python handler;
    after it the handlers are as they were, and then `after()` runs.

    A signal can land while the handlers are being replaced or put back (its handler runs between two of those
    calls, or at the entry of `__exit__`): one landing in `__enter__` puts them back before it is raised, one
    landing at or in `__exit__` finishes putting them back (and runs `after()`) before its own handler runs.
    Before, a Ctrl-C landing just as a sync save replaced SIGINT's handler left it replaced for good, wrapped
    once more by each such save. A class, not a generator context manager: contextlib's `__enter__` and
    `__exit__` frames would be more such places, where the block's handlers are in force but nobody puts them
    back. Only the main thread runs signal handlers; elsewhere, and for SIG_IGN/SIG_DFL, nothing changes.

    `defers` (`signals_deferred`): a signal an enclosing deferring block already holds is left to it. Before, the
    inner block held it once more, handed it to the outer one as sent for the first time on its way out, and a
    signal sent again inside the inner block was held as a first one by the outer: it no longer ran at once.
    """

    def __init__(
        self,
        replacement: Callable[[int, Handler], Handler],
        after: Callable[[], None] = lambda: None,
        defers: bool = False,
    ):
        self._replacement = replacement
        self._after = after
        self.defers = defers
        self._previous: dict[int, Handler] = {}
        self._replaced: dict[int, Handler] = {}
        self._closed = False
        self._handler: Handler = self._guarded  # one bound method, so that `getsignal(n) is` finds it

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = {
            n: h
            for n in WATCHED_SIGNALS
            if callable(h := signal.getsignal(n)) and not (self.defers and _deferring_block(h) is not None)
        }
        self._replaced = {signum: self._replacement(signum, h) for signum, h in self._previous.items()}
        try:
            for signum in self._previous:
                signal.signal(signum, self._handler)
        except BaseException:  # a replaced handler raised between two of these
            self._closed = True
            self._finish()
            raise

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._finish()

    def _finish(self) -> None:
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) is self._handler:
                signal.signal(signum, handler)
        self._after()

    def _guarded(self, signum: int, frame: Any) -> None:
        if self._closed or (frame is not None and frame.f_code is _EXIT_CODE):  # the block has ended
            self._closed = True
            self._finish()
            self._previous[signum](signum, frame)
        else:
            self._replaced[signum](signum, frame)


_EXIT_CODE = handlers_replaced.__exit__.__code__


def _deferring_block(handler: Handler) -> handlers_replaced | None:
    """The open `signals_deferred` block whose handler `handler` is, else None."""
    block = getattr(handler, "__self__", None)
    return block if isinstance(block, handlers_replaced) and block.defers and not block._closed else None


def signals_deferred(what: str, *, quiet: bool = False, held: Held = COPY_HELD) -> handlers_replaced:
    """`with signals_deferred(what):` runs the Python handlers of signals that arrive inside the block after it
    (see the module docstring). A held signal is said at WARNING, in the words of `held` (a block that may last:
    the person who pressed Ctrl-C learns that it was heard, and how to stop the block now).

    `quiet`: no WARNING, for a block of a few milliseconds (starting a thread), where the signal is only
    postponed.
    """
    pending: list[int] = []

    def deferring(signum: int, handler: Handler) -> Handler:
        def deferred(signum: int, frame: Any) -> None:
            if signum in pending:
                try:
                    handler(signum, frame)
                except BaseException:  # it cuts the block short; a handler that returns (a timer's) cut nothing
                    if not quiet:
                        _warn("%s: %s again: its handler runs now, and %s", what, signum, held.cut_short)
                    raise
                return
            pending.append(signum)
            if not quiet:
                _warn(
                    "%s: %s during %s; its handler runs once %s (%s: %s)",
                    what,
                    signum,
                    held.during,
                    held.until,
                    held.again,
                    held.cut_short,
                )

        return deferred

    def deliver() -> None:
        sent = pending.copy()
        pending.clear()
        _deliver(sent)

    return handlers_replaced(deferring, deliver, defers=True)


def start_thread(thread: threading.Thread) -> None:
    """`thread.start()` (bounded: `start_bounded`), with the signals deferred until it has returned.

    `Thread.start()` waits on an Event for the new thread to say it runs; a KeyboardInterrupt landing in that
    wait left the Event's lock held, and the new thread blocked for good before running anything (a worker
    pool's thread never took a job). A signal that arrives meanwhile runs its handler once the thread runs.
    """
    with signals_deferred(f"starting thread {thread.name}", quiet=True):
        start_bounded(thread)


# How long a new thread may take to say it runs (`start_bounded`): far past any scheduling delay.
_THREAD_START_S = 30.0


class _BoundedStart(threading.Event):
    """The Event `Thread.start()` waits on for the new thread to say it runs, with that wait bounded.

    A thread that says it runs only after the wait gave up (`given_up`) runs nothing: its caller was told it
    failed (`start_bounded`). Before, a thread merely slow to be scheduled (a process stopped and continued, a
    machine swapping) ran its target anyway: a pool's thread the pool never counted waited on its jobs for good.
    The flag and the decision are taken under the Event's own lock, so the two cannot cross.
    """

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__()
        self._thread = weakref.ref(thread)
        self._waited = False
        self.given_up = False

    def wait(self, timeout: float | None = None) -> bool:
        if self._waited:  # not the start's wait
            return super().wait(timeout)
        with self._cond:  # type: ignore[attr-defined]
            self._waited = True
            if not self._flag:
                self._cond.wait(_THREAD_START_S if timeout is None else timeout)  # type: ignore[attr-defined]
                self.given_up = not self._flag
            return not self.given_up

    def set(self) -> None:
        """The decision and the flag in one hold of the lock: set in a second step, a wait that ran out between
        the two read the flag unset and told its caller the thread failed, and the thread, not given up on when it
        looked, ran its target."""
        with self._cond:  # type: ignore[attr-defined]
            thread = self._thread() if self.given_up else None
            if thread is not None:
                thread.run = _nothing  # type: ignore[method-assign]  # looked up once set() has returned
            self._flag = True  # what Event.set does, under the same hold
            self._cond.notify_all()  # type: ignore[attr-defined]


def _nothing() -> None:
    """What a thread given up on runs (`_BoundedStart`)."""


def start_bounded(thread: threading.Thread) -> None:
    """`thread.start()`, or a `MemoryError` naming the thread and the fix where the OS refused it or where it died
    in its own start-up before it ran. The latter under a low RLIMIT_AS: the OS made the thread, whose first
    allocation then failed (CPython prints "Exception ignored in thread started by ... MemoryError"), and
    `Thread.start()`, waiting without a bound for the thread to say it runs, hung the save for good. A thread
    given up on that starts after all runs nothing (`_BoundedStart`)."""
    seen = getattr(thread, "_started", None)
    if type(seen) is threading.Event and not seen.is_set():  # CPython's; a started thread's start() refuses
        thread._started = _BoundedStart(thread)  # type: ignore[attr-defined]
    try:
        thread.start()
    except RuntimeError as exc:
        raise_if_thread_not_started(exc, thread.name)
        raise
    if getattr(thread._started, "given_up", False):  # type: ignore[attr-defined]
        raise MemoryError(
            f"Out of memory starting thread {thread.name}: the OS made it, but it died in its own start-up before "
            f"it ran (not running within {_THREAD_START_S:g}s; should it start after all, it runs nothing): the "
            f"address-space limit (RLIMIT_AS, `ulimit -v`) or the machine's memory. Free memory, or raise the "
            f"limit, and try again."
        )


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


def _warn(message: str, what: str, signum: int, *words: str) -> None:
    log_safely(logger, logging.WARNING, message, what, signal_name(signum), *words)


def signal_name(signum: int) -> str:
    """How a message names the signal `signum`: by its own name (a SIGTERM whose handler raises KeyboardInterrupt
    is still SIGTERM), SIGINT with its usual sender beside it. Not "Ctrl-C" alone: a handler is not told who sent
    the signal (no siginfo), and a `kill -INT` or a scheduler's SIGINT was said to be a Ctrl-C nobody pressed."""
    name = signal.Signals(signum).name
    return f"{name} (Ctrl-C)" if signum == signal.SIGINT else name
