"""A Ctrl-C at any point where Python can run a signal handler leaves every other thread's call working.

Python runs a signal handler between two bytecodes of the main thread: at a function's entry and just after a
call into C returns. `threading.Condition`/`Event` take and give back their lock in Python frames, so a
KeyboardInterrupt landing in one left the lock held by the interrupted thread:
* the manager's call registry was a Condition: a Ctrl-C in a `load()` entering it left it held, and every
  save(), load() and close() on another thread then waited forever;
* a generator context manager registered each call: an interrupt at its `__exit__`'s entry left the call
  registered, and close() waited for it until `save.wait_timeout_secs`;
* the writer process's readiness was an Event: an interrupt in its wait left its lock held, and the thread that
  sets it (and every later wait) blocked for good;
* `Thread.start()` waits on an Event: an interrupt there left the new thread blocked before it ran anything,
  so a worker pool's first thread never took a job;
* a sync save replaced the signal handlers before its `try`: an interrupt just after SIGINT's was replaced
  left it replaced, wrapped once more by each such save.

Instead of waiting for a storm to hit such a window, `probes.interrupted_at` raises at each point in turn
(every function entry and every C call's return in the frames of the engine's and the stdlib's synchronisation
code) and, after each interrupted call, checks from another thread that a load and a save still work (bounded:
a hang is a failure, not a stuck suite), that the interrupted call raised KeyboardInterrupt and nothing else,
left the signal handlers as they were, and, for a load, left the templates either untouched or whole. One
child process runs every sweep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.probes import REPO

CHILD = textwrap.dedent(
    """
    import faulthandler, json, os, signal, sys, threading, time
    import torch
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.checkpoint_process import CheckpointProcess
    from torch_checkpointing.futures import WorkerPool
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    from tests.probes import interrupted_at

    SYNC_FILES = (
        "threading.py", "queue.py", "contextlib.py", "concurrent/futures/_base.py", "concurrent/futures/thread.py",
        "torch_checkpointing/checkpoint_manager.py", "torch_checkpointing/checkpoint_process.py",
        "torch_checkpointing/checkpoint_writer.py",
        "torch_checkpointing/futures.py", "torch_checkpointing/lock.py", "torch_checkpointing/signals.py",
        "torch_checkpointing/waiting.py",
    )
    BOUND_S = 20.0

    def state(v):
        return {"model": {"a": torch.full((1024,), float(v)), "b": torch.full((1024,), float(v) + 0.5)}}

    def same(into, v):
        return all(torch.equal(into["model"][k], state(v)["model"][k]) for k in "ab")

    def bounded(fn, seconds=BOUND_S):
        box = {}
        def run():
            try:
                fn()
            except BaseException as exc:
                box["error"] = f"{type(exc).__name__}: {exc}"[:300]
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(seconds)
        if t.is_alive():
            faulthandler.dump_traceback(all_threads=True)
            return "hang"
        return box.get("error", "ok")

    def handlers():
        return {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}

    def sweep(op, check, limit=5000, prepare=lambda: None):
        found = []
        before = handlers()
        for k in range(limit):
            prepare()
            with interrupted_at(k, SYNC_FILES) as at:
                try:
                    op()
                except KeyboardInterrupt:
                    pass
                except BaseException as exc:
                    found.append([at.where, f"raised {type(exc).__name__}: {exc}"[:300]])
            if handlers() != before:
                found.append([at.where, "signal handlers left replaced"])
                for n, h in before.items():
                    signal.signal(n, h)
            if at.where is None:
                return {"points": k, "found": found}
            after = check()
            if after != "ok":
                found.append([at.where, after])
                if after == "hang":
                    break
        return {"points": k, "found": found}

    def manager_sweeps(root, config, out, name):
        manager = CheckpointManager(config)
        def wait(f):
            if f is not None:
                f.result(60)
        wait(manager.save(f"{root}/{name}/base", state(7)))
        def load():
            into = state(0)
            try:
                manager.load(f"{root}/{name}/base", into=into)
            finally:
                if not (same(into, 0) or same(into, 7)):
                    raise AssertionError("the templates were left half restored")
        def check():
            def both():
                into = state(0)
                manager.load(f"{root}/{name}/base", into=into)
                assert same(into, 7), "a later load restored the wrong values"
                wait(manager.save(f"{root}/{name}/other", state(3)))
            return bounded(both)
        out[f"{name}_load"] = sweep(load, check)
        out[f"{name}_save"] = sweep(lambda: wait(manager.save(f"{root}/{name}/s", state(5))), check)
        out[f"{name}_close"] = bounded(manager.close, 60)

    def process_sweep(root, out):
        # The writer's readiness, without spawning a writer per point: `_start` only says it is ready.
        def started(self):
            time.sleep(0.005)
            self._ready.set()
        CheckpointProcess._start = started
        process = CheckpointProcess(LocalFileSystemStorageConfig())
        def op():
            process._start_in_background()
            process.ensure_ready()
        def check():
            def again():
                process._start_in_background()
                process.ensure_ready()
            return bounded(again)
        out["writer_ready"] = sweep(op, check)

    def pool_sweep(out):
        pools = []
        def prepare():
            pools.append(WorkerPool(1, "ckpt-sweep"))  # a new pool: its first submit starts its thread
        def op():
            pools[-1].submit(lambda: 1).result(BOUND_S)
        def check():
            return bounded(lambda: pools[-1].submit(lambda: 2).result(BOUND_S + 5))
        out["pool_first_submit"] = sweep(op, check, prepare=prepare)

    if __name__ == "__main__":
        root = sys.argv[1]
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # a job's preemption handler
        out = {}
        manager_sweeps(root, CheckpointManager.Config.with_sync_save(), out, "sync")
        manager_sweeps(root, CheckpointManager.Config(), out, "async")
        pool_sweep(out)
        process_sweep(root, out)
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)
    """
)


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("interrupt_points")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(root)], capture_output=True, text=True, env=env, timeout=600
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the sweeps did not end in 600 s:\n{str(exc.stderr)[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rc {done.returncode}, no result; stderr:\n{done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


@pytest.mark.parametrize("saves", ["sync", "async"])
@pytest.mark.parametrize("call", ["load", "save"])
def test_an_interrupt_at_any_point_of_a_call_leaves_the_manager_working(
    swept: dict[str, Any], saves: str, call: str
) -> None:
    sweep = swept[f"{saves}_{call}"]
    assert sweep["points"] > 20, sweep  # the sweep reached the calls' synchronisation code
    assert sweep["found"] == [], sweep  # [where, what]: a hang, another exception, half-restored templates


@pytest.mark.parametrize("saves", ["sync", "async"])
def test_close_after_every_interrupted_call_returns(swept: dict[str, Any], saves: str) -> None:
    assert swept[f"{saves}_close"] == "ok"  # was "hang": a call left registered (or the registry held)


def test_an_interrupt_while_waiting_for_the_writer_to_start_leaves_the_wait_working(swept: dict[str, Any]) -> None:
    sweep = swept["writer_ready"]
    assert sweep["points"] > 3, sweep
    assert sweep["found"] == [], sweep


def test_an_interrupt_while_a_pool_starts_its_thread_leaves_the_pool_working(swept: dict[str, Any]) -> None:
    sweep = swept["pool_first_submit"]
    assert sweep["points"] > 3, sweep
    assert sweep["found"] == [], sweep
