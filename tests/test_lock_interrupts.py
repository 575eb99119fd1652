"""A Ctrl-C landing while `lock()` waits for the staging copy comes out as KeyboardInterrupt.

The wait was `threading.Condition.wait`, which gives the mutex back in a Python frame: an interrupt landing
just after that left the mutex released, and the `with` around the wait then raised `RuntimeError: cannot
release un-acquired lock` instead of the KeyboardInterrupt a training script's `except KeyboardInterrupt`
expects (1-2 per 4 s SIGINT storm). A child takes the read side in a loop while a thread takes the write side
(as the staging copy does) again and again, so that the read side waits and wakes many times a millisecond;
the test delivers SIGINT to it about every millisecond.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.probes import stormed_child

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from torch_checkpointing.lock import RWLock, RWLockMode
    from tests.probes import armed_sigint
    if __name__ == "__main__":
        stop = sys.argv[1]
        lock = RWLock()
        counts = {"takes": 0, "interrupts": 0, "ignored": 0, "other": 0}
        armed = armed_sigint(counts)
        done = threading.Event()
        def writer():  # takes and gives back the write side in a tight loop: the reader waits and wakes again and again
            while not done.is_set():
                token = lock.acquire(RWLockMode.WRITE, timeout=5)
                time.sleep(0.0002)
                lock.release(RWLockMode.WRITE, token)
                time.sleep(0.0005)
        t = threading.Thread(target=writer, daemon=True); t.start()
        print("ready", flush=True)
        while not os.path.exists(stop):
            try:
                armed[0] = True
                with lock.hold(RWLockMode.READ, timeout=5):
                    armed[0] = False
                counts["takes"] += 1
            except KeyboardInterrupt:
                counts["interrupts"] += 1
            except BaseException as exc:
                armed[0] = False
                counts["other"] += 1
                counts["last"] = f"{type(exc).__name__}: {exc}"[:200]
        armed[0] = False
        done.set(); t.join(5)
        time.sleep(0.3)
        out = dict(counts)
        try:
            with lock.hold(RWLockMode.WRITE, timeout=2):
                out["after"] = "ok"
        except BaseException as exc:
            out["after"] = f"{type(exc).__name__}: {exc}"[:200]
        print("RESULT " + json.dumps(out), flush=True)
    """
)


def test_a_sigint_storm_on_a_waiting_lock_raises_only_keyboardinterrupt(tmp_path: Path) -> None:
    result, _ = stormed_child(CHILD, tmp_path / "stop", seconds=6.0, pause_s=0.0005)
    assert result["interrupts"] > 100 and result["takes"] > 1000, result  # the storm landed in waits that ran
    assert result["other"] == 0, result  # was RuntimeError: cannot release un-acquired lock
    assert result["after"] == "ok", result  # nothing left held
