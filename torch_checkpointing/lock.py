"""A reader/writer lock whose write side may be released by another thread.

The staging copy holds the write side (taken by `save()` on the caller's thread, released by the staging
thread when the copy is done); `CheckpointManager.lock()` takes the read side around optimizer steps.
The lock knows which threads hold its read side: a thread asking for the write side while it holds the read
side (a `save()` inside `with manager.lock():`) would wait for itself, so it is refused at once.

A waiting writer goes before new readers: a training thread taking `lock()` back to back (one optimizer step
after the other) otherwise kept the read side held, or retaken within microseconds, so that a `save()` on another
thread never found it free and failed as a deadlock after `wait_timeout_secs`. A thread that already holds the
read side still gets it again (a nested `lock()`): making it wait for the writer would wait for itself.

Ctrl-C: every hold is registered under a token (the `hold()` object, or the saver's releaser) in one store
inside the acquire's critical section, and released by that token, a no-op for a token never registered. So
the acquire runs inside the `try` that releases: a KeyboardInterrupt landing before the acquire counted the
hold, after it, or between its return and the `with` body releases exactly what was taken. `RWLockHold.__exit__`
gives the hold back in its first statement; an interrupt at its very entry (the one point Python leaves) is
covered by `__del__`: the registry keys holds by `id(token)`, never keeping the token alive, so a hold whose
object is gone (the interrupted statement's frame and traceback freed) is given back then. Waits re-check every
`waiting.RECHECK_S`, in case such a release could not notify. The critical sections use a C-level RLock as
their `with` target, and a waiter sleeps outside it (`waiting.Wakeups`): `threading.Condition`'s `__exit__`
and `wait` are Python frames in which an interrupt could skip the unlock, or unlock twice.
(A hold taken without a token, `acquire(mode)` then `release(mode)`, keeps the window between the two calls;
the engine takes none that way.)
"""

from __future__ import annotations

import threading
from enum import Enum
from types import TracebackType

from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.waiting import Wakeups

__all__ = ["DEFAULT_ACQUIRE_TIMEOUT_SECS", "RWLock", "RWLockHold", "RWLockMode"]

DEFAULT_ACQUIRE_TIMEOUT_SECS = 600.0


class RWLockMode(Enum):
    READ = "read"
    WRITE = "write"


class RWLock:
    def __init__(self) -> None:
        self._mutex = threading.RLock()
        self._wakeups = Wakeups()  # the acquires waiting, each outside the mutex on a lock of its own
        # Holds by id(token), never the token itself: a hold's object that is gone must be able to go (its
        # __del__ gives the hold back). Each value: the ident of the thread that took it, and the token when
        # acquire() made it (kept until released; a caller's own token stays the caller's).
        self._read_holds: dict[int, tuple[int, object | None]] = {}
        self._writer: tuple[int, object | None] | None = None
        self._writers_waiting = 0

    @property
    def _readers(self) -> int:
        return len(self._read_holds)

    def held_by_this_thread(self) -> bool:
        """Whether the calling thread holds the read side (it is inside `with manager.lock():`)."""
        with self._mutex:
            return self._holds_read(threading.get_ident())

    def _holds_read(self, me: int) -> bool:
        # list() first, in one C call: `RWLockHold.__exit__` pops from the dict without the mutex
        return any(ident == me for ident, _ in list(self._read_holds.values()))

    def acquire(
        self, mode: RWLockMode, timeout: float | None = DEFAULT_ACQUIRE_TIMEOUT_SECS, token: object | None = None
    ) -> object:
        """Take one hold, registered under `token` (a new one if None); returns the token to release it by."""
        kept = object() if token is None else None
        token = kept if token is None else token
        me = threading.get_ident()
        counted = False  # whether this call counts among the writers waiting
        try:
            with self._mutex:
                if mode is RWLockMode.WRITE and self._holds_read(me):
                    raise CheckpointError(
                        "The checkpoint write lock was asked for by a thread that holds its read side: a save() "
                        "inside `with manager.lock():` would wait for itself. Call save() after the with block."
                    )
                nested = mode is RWLockMode.READ and self._holds_read(me)
                if mode is RWLockMode.WRITE:  # new readers queue behind this writer from now on; one line, so
                    self._writers_waiting, counted = self._writers_waiting + 1, True  # no interrupt between the two

            def take() -> bool:
                if not self._free_for(mode, nested):
                    return False
                # One store each: the hold is either registered (its token releases it) or not taken.
                if mode is RWLockMode.READ:
                    self._read_holds[id(token)] = (me, kept)
                else:
                    self._writer = (id(token), kept)
                return True

            if not self._wakeups.wait_for(self._mutex, take, timeout):
                # RuntimeError, not a CheckpointError: the type recorded in API_SURFACE §10, which callers catch
                raise RuntimeError(
                    f"Failed to acquire the checkpoint {mode.value} lock after {timeout} seconds; this is likely "
                    f"a deadlock (a staging copy that never finished, or a lock() another thread never released)."
                )
            return token
        finally:
            if counted:
                with self._mutex:
                    self._writers_waiting -= 1
                    self._wakeups.notify_all()  # readers held back by this writer re-check, whether it got the lock

    def _free_for(self, mode: RWLockMode, nested: bool) -> bool:
        """(Holding the mutex.) A reader waits behind a waiting writer, unless it holds the read side already."""
        if mode is RWLockMode.READ:
            return self._writer is None and (nested or not self._writers_waiting)
        return self._writer is None and not self._read_holds

    def release(self, mode: RWLockMode, token: object | None = None) -> bool:
        """Give back the hold registered under `token`; False (and nothing changed) if it holds none.

        Without a token: the write side whoever holds it, or one read hold of the calling thread.
        """
        with self._mutex:
            released = self._forget(mode, token)
            if released:
                self._wakeups.notify_all()
            return released

    def wake(self) -> None:
        """Let the waiters re-check (after a hold was given back without the mutex, by `RWLockHold.__exit__`)."""
        with self._mutex:
            self._wakeups.notify_all()

    def holds_unlocked(self, token: object) -> bool:
        """Whether `token` holds either side, read without the mutex (one dict lookup, safe under the GIL)."""
        writer = self._writer
        return (writer is not None and writer[0] == id(token)) or id(token) in self._read_holds

    def holds(self, mode: RWLockMode, token: object) -> bool:
        """Whether `token` holds the lock in `mode` now."""
        with self._mutex:
            if mode is RWLockMode.WRITE:
                return self._writer is not None and self._writer[0] == id(token)
            return id(token) in self._read_holds

    def _forget(self, mode: RWLockMode, token: object | None) -> bool:
        if mode is RWLockMode.WRITE:
            if self._writer is None or (token is not None and self._writer[0] != id(token)):
                return False
            self._writer = None
            return True
        if token is None:
            me = threading.get_ident()
            key = next((k for k, (ident, _) in list(self._read_holds.items()) if ident == me), None)
        else:
            key = id(token)
        return key is not None and self._read_holds.pop(key, None) is not None

    def hold(self, mode: RWLockMode, timeout: float | None = DEFAULT_ACQUIRE_TIMEOUT_SECS) -> RWLockHold:
        """`with lock.hold(mode):` — the hold is released on any exit, an interrupt in the acquire included."""
        return RWLockHold(self, mode, timeout)


class RWLockHold:
    """One hold of an `RWLock`, as a context manager; the object itself is the hold's token.

    `__enter__` releases what its own acquire took if anything interrupts it (a KeyboardInterrupt raised after
    the hold was registered, before `__enter__` returned, skips `__exit__`). `__exit__` gives the hold back in
    its first statement, one C-level store, so that an interrupt can land only at its entry; that last window
    is closed by `__del__`: a hold whose object is gone (the interrupted `with` statement's frame, and the
    traceback that kept it, were freed) is given back then.
    """

    def __init__(self, lock: RWLock, mode: RWLockMode, timeout: float | None) -> None:
        self._lock = lock
        self._mode = mode
        self._timeout = timeout

    def __enter__(self) -> None:
        try:
            self._lock.acquire(self._mode, self._timeout, self)
        except BaseException:
            self._lock.release(self._mode, self)
            raise

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        # Inlined, not a call: a Python call's entry is where an interrupt lands (see the module docstring).
        if self._mode is RWLockMode.READ:
            self._lock._read_holds.pop(id(self), None)
        elif self._lock._writer is not None and self._lock._writer[0] == id(self):
            self._lock._writer = None
        self._lock.wake()

    def __del__(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None and lock.holds_unlocked(self):
            lock.release(self._mode, self)
