"""Ctrl-C landing anywhere around `manager.lock()` and `save()` leaks no hold of the staging lock.

A real child process takes `manager.lock()` in a tight loop (an optimizer step each time) and saves every few
steps, while this test delivers SIGINT to it about every millisecond. Each KeyboardInterrupt is caught by the
child's loop, as a training script's `except KeyboardInterrupt` does. Before the fix a KeyboardInterrupt that
landed between the lock's acquire returning and the `try` that releases it (or inside the acquire, after the hold
was counted) left a read hold nobody owned, and every later save failed: refused as a save "inside `with
manager.lock():`" on the training thread, or a deadlock after `wait_timeout_secs` from any other thread.
Afterwards the child must take the write side from another thread at once and finish a save, bounded.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.probes import stormed_child

STORM_S = 4.0
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import torch
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.lock import RWLockMode
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    from tests.probes import armed_sigint

    stop, root = sys.argv[1], sys.argv[2]
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = 20
    manager = CheckpointManager(config)
    manager.save(f"{root}/first", {"w": torch.zeros(8)}).result(60)
    w = torch.zeros(8)
    counts = {"steps": 0, "interrupts": 0, "ignored": 0, "saves": 0, "save_errors": 0}
    armed = armed_sigint(counts)  # every interrupt lands in lock()/save(), none in the loop's own bookkeeping
    print("ready", flush=True)
    while not os.path.exists(stop):
        try:
            armed[0] = True
            with manager.lock():
                w.add_(1)
            counts["steps"] += 1
            if counts["steps"] % 200 == 0:
                try:
                    future = manager.save(f"{root}/loop", {"w": w})
                    counts["saves"] += 1
                    future.result(20)
                except KeyboardInterrupt:
                    raise
                except Exception as exc:
                    counts["save_errors"] += 1
                    counts["last_save_error"] = f"{type(exc).__name__}: {exc}"[:300]
            armed[0] = False
        except KeyboardInterrupt:
            counts["interrupts"] += 1
        except Exception as exc:  # lock() itself failed (the deadlock): report it
            armed[0] = False
            counts["loop_error"] = f"{type(exc).__name__}: {exc}"[:400]
            break
    armed[0] = False
    time.sleep(0.5)  # the last SIGINT sent is delivered and handled before the checks
    out = dict(counts)
    try:
        lock = manager._saver._staging_lock
        took = []
        def writer():
            try:
                lock.acquire(RWLockMode.WRITE, timeout=5)
                lock.release(RWLockMode.WRITE)
                took.append("ok")
            except Exception as exc:
                took.append(f"{type(exc).__name__}: {exc}")
        t = threading.Thread(target=writer)
        t.start()
        t.join(10)
        out["write_side_from_another_thread"] = took[0] if took else "hung"
        started = time.monotonic()
        try:
            manager.save(f"{root}/after", {"w": torch.ones(8)}).result(20)
            out["save_after"] = "ok"
        except Exception as exc:
            out["save_after"] = f"{type(exc).__name__}: {exc}"[:400]
        out["save_after_s"] = time.monotonic() - started
        manager.close()
    finally:
        print("RESULT " + json.dumps(out), flush=True)
    """
)


def test_sigint_storm_around_lock_and_save_leaks_no_lock_hold(tmp_path: Path) -> None:
    result, sent = stormed_child(CHILD, tmp_path / "stop", str(tmp_path / "ckpt"), seconds=STORM_S)
    assert result["interrupts"] > 100 and sent > 100, result  # the storm really landed
    assert "loop_error" not in result, result
    assert result["save_errors"] == 0, result  # was a RuntimeError (a Future's lock released twice), or a wedge
    assert result["write_side_from_another_thread"] == "ok", result
    assert result["save_after"] == "ok", result
    assert result["save_after_s"] < 15, result
