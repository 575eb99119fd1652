"""A thread's start given up on runs nothing, also where the thread says it runs while its caller gives up (round 31).

Round 30's `_BoundedStart.set` decided under the Event's lock whether the thread was given up on, then let go of
the lock and set the flag in a second step. A caller whose bounded wait ran out between the two read the flag
unset, raised a `MemoryError` ("should it start after all, it runs nothing"), and the thread, its decision taken
already, ran its target. Here the new thread is held in that gap (a trace function of its own, installed in its
start-up) until its caller's wait is over: what the caller is told and what the thread does must agree.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

import pytest

from torch_checkpointing import signals


class _HeldOnceUnlocked(threading.Thread):
    """A thread that, in the Event's `set` it calls to say it runs, stops at the first line met after it has held
    the Event's lock and let go of it with the flag still unset, until `gate` is set."""

    gate = threading.Event()
    held = threading.Event()

    def _set_tstate_lock(self) -> None:
        sys.settrace(self._trace)
        super()._set_tstate_lock()  # type: ignore[misc]

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        event_obj = frame.f_locals.get("self")
        if event != "call" or frame.f_code.co_name != "set" or not isinstance(event_obj, signals._BoundedStart):
            return None
        was_locked = False

        def lines(frame: FrameType, event: str, arg: Any) -> Any:
            nonlocal was_locked
            locked = event_obj._cond._lock.locked()  # type: ignore[attr-defined]
            if event == "line" and was_locked and not locked and not event_obj.is_set() and not self.held.is_set():
                self.held.set()
                assert self.gate.wait(120), "the test never let the thread go on"
            was_locked = was_locked or locked
            return lines

        return lines


@pytest.fixture(autouse=True)
def _bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signals, "_THREAD_START_S", 2.0)  # room for the thread to reach `set`; then it is held
    _HeldOnceUnlocked.gate = threading.Event()
    _HeldOnceUnlocked.held = threading.Event()


def test_what_the_caller_is_told_is_what_the_thread_does() -> None:
    """Defect: the caller's MemoryError, then `ran == ['ran']` (the thread ran its target after all)."""
    ran: list[str] = []
    thread = _HeldOnceUnlocked(target=ran.append, args=("ran",), name="t-window", daemon=True)
    try:
        signals.start_bounded(thread)
        refused = False
    except MemoryError:
        refused = True
    finally:
        _HeldOnceUnlocked.gate.set()
    assert thread._started.wait(120)  # type: ignore[attr-defined]
    thread.join(120)
    assert not thread.is_alive()
    assert (refused, ran) in [(True, []), (False, ["ran"])], (refused, ran, _HeldOnceUnlocked.held.is_set())
