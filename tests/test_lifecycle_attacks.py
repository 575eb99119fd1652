"""The manager's lifecycle under misuse: calls in the wrong order, from the wrong thread or the wrong process.

Each test drives a real async manager (a spawned writer process, real files). What they pin:
* `save()` inside `with manager.lock():` on the same thread can never get the staging lock; it is refused at
  once (not after `wait_timeout_secs`), while a save from another thread still just waits for the holder.
* `close()` from another thread while a `save()` runs waits for that save instead of pulling the writer and
  the staging slab out from under it.
* `load()` of an id this manager's async save is still writing waits for that save and restores what it
  saved (the design document's `save(path, ...)` then `load(path, ...)`), for a new id and for one being
  replaced; if that save fails, the load raises with its error and restores nothing; a load of another id
  never waits.
* a manager copied into an `os.fork()`ed child refuses to be used there, and the child's exit leaves the
  parent's writer process alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import Control, RecordingStorageConfig, SlowCopy
from tests.probes import run_script
from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import CheckpointError

WAIT_S = 60  # also each first save's bound, which includes spawning the writer: 18 s seen on 2 very busy cores


def _manager(control: Control) -> CheckpointManager:
    config = CheckpointManager.Config(storage_config=RecordingStorageConfig(control_dir=str(control.root)))
    config.save.wait_timeout_secs = WAIT_S
    return CheckpointManager(config)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CheckpointManager, Control]]:
    """One async manager for the tests that leave it open (a writer process costs seconds to start)."""
    control = Control(tmp_path_factory.mktemp("control"))
    manager = _manager(control)
    yield manager, control
    control.reset()
    manager.close()


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[tuple[CheckpointManager, Control]]:
    control = Control(tmp_path / "control")
    manager = _manager(control)
    yield manager, control
    control.reset()
    manager.close()


def _release_soon(control: Control) -> None:
    """Half a second from now, the write held by `control.block(...)` goes on.

    A held write, not a delayed one: "the save is still in flight" was asserted within a 1-3 s write delay,
    which a busy machine's save() alone could outlast."""
    threading.Timer(0.5, lambda: (control.root / "block_on").unlink(missing_ok=True)).start()


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((8,), value)}}


def _wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def _loaded(manager: CheckpointManager, checkpoint_id: str) -> float:
    into = _state(0.0)
    manager.load(checkpoint_id, into)
    return float(into["model"]["w"][0])


# ------------------------------------------------------------------------------------------ save inside lock()


def test_save_inside_lock_on_the_same_thread_is_refused_at_once(
    shared: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, _ = shared
    target = str(tmp_path / "inside")
    started = time.monotonic()
    with manager.lock(), pytest.raises(CheckpointError, match=r"inside `with manager.lock\(\):`") as caught:
        manager.save(target, _state(1.0))
    assert time.monotonic() - started < WAIT_S / 3, "the refusal waited for the lock timeout first"
    assert "lock()" in str(caught.value) and target in str(caught.value)
    assert not Path(target).exists()
    manager.save(target, _state(2.0)).result(WAIT_S)  # the lock was left free: the same save works outside
    assert _loaded(manager, target) == 2.0


def test_save_inside_nested_lock_is_refused_and_the_lock_stays_usable(
    shared: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, _ = shared
    with manager.lock(), manager.lock(), pytest.raises(CheckpointError, match="lock"):
        manager.save(str(tmp_path / "nested"), _state(1.0))
    with manager.lock():
        pass
    manager.save(str(tmp_path / "after"), _state(3.0)).result(WAIT_S)
    assert _loaded(manager, str(tmp_path / "after")) == 3.0


def test_prewarm_staging_inside_lock_says_so(shared: tuple[CheckpointManager, Control]) -> None:
    manager, _ = shared
    with manager.lock(), pytest.raises(RuntimeError, match=r"inside `with manager.lock\(\):`"):
        manager.prewarm_staging(_state(1.0))
    with manager.lock():  # the lock was left as it was: held and released once more
        pass


def test_save_from_another_thread_waits_for_the_lock_holder(
    shared: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, _ = shared
    target = str(tmp_path / "other_thread")
    outcome: dict[str, Any] = {}

    def save() -> None:
        try:
            outcome["future"] = manager.save(target, _state(4.0))
        except BaseException as exc:
            outcome["error"] = exc

    with manager.lock():
        saver = threading.Thread(target=save)
        saver.start()
        staging_lock = manager._saver._staging_lock  # type: ignore[attr-defined]
        deadline = time.monotonic() + WAIT_S
        while not staging_lock._writers_waiting and saver.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert saver.is_alive(), f"the other thread's save did not wait for lock(): {outcome}"
        assert staging_lock._writers_waiting, "the save never came to wait for the lock: the test proves nothing"
    saver.join(WAIT_S)
    assert "error" not in outcome, outcome
    outcome["future"].result(WAIT_S)
    assert _loaded(manager, target) == 4.0


# ------------------------------------------------------------------------------ close() from another thread


@pytest.mark.filterwarnings("ignore:Item 'slow' holds")  # the slow value is staged, never loaded
def test_close_from_another_thread_waits_for_a_running_save(
    fresh: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, _ = fresh
    manager.save(str(tmp_path / "first"), _state(1.0)).result(WAIT_S)  # the writer is up
    target = str(tmp_path / "during_close")
    outcome: dict[str, Any] = {}

    def save() -> None:
        try:
            future = manager.save(target, {**_state(5.0), "slow": SlowCopy(1.5)})
            outcome["result"] = future.result(WAIT_S)
        except BaseException as exc:
            outcome["error"] = exc

    copies = SlowCopy.copies
    saver = threading.Thread(target=save)
    saver.start()
    _wait_until(lambda: SlowCopy.copies > copies or not saver.is_alive())  # the save is in its staging copy
    manager.close()
    saver.join(WAIT_S)
    assert outcome == {"result": None}, outcome
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
        into = _state(0.0)
        reader.load(target, into)
    assert float(into["model"]["w"][0]) == 5.0


def test_an_interrupt_just_before_the_write_is_handed_over_does_not_stall_the_next_save(
    fresh: tuple[CheckpointManager, Control], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C landing between the staging copy and the hand-off to the comm thread (microseconds wide, so it
    is injected there) left a write Future nobody would resolve: the next save waited wait_timeout_secs for it."""
    manager, _ = fresh
    manager.save(str(tmp_path / "first"), _state(1.0)).result(WAIT_S)
    comm = manager._saver._comm  # type: ignore[attr-defined]

    def interrupted(job: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(comm, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        manager.save(str(tmp_path / "interrupted"), _state(2.0))
    monkeypatch.undo()
    started = time.monotonic()
    manager.save(str(tmp_path / "next"), _state(3.0)).result(WAIT_S)
    assert time.monotonic() - started < WAIT_S / 3, "the next save waited for the interrupted one"
    assert _loaded(manager, str(tmp_path / "next")) == 3.0
    assert not (tmp_path / "interrupted").exists()


def test_calls_after_close_from_another_thread_are_refused(fresh: tuple[CheckpointManager, Control]) -> None:
    manager, _ = fresh
    closer = threading.Thread(target=manager.close)
    closer.start()
    closer.join(WAIT_S)
    with pytest.raises(RuntimeError, match="closed CheckpointManager"):
        manager.save("never", _state(1.0))
    manager.close()  # idempotent from any thread


# ------------------------------------------------------------------------------------- load of an in-flight id


def test_load_of_an_id_whose_first_save_is_in_flight_waits_for_it(
    shared: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    """The design document's resharder snippet and full example call save(path) then load(path) with the default
    (async) config. The load raised FileNotFoundError ("still being written") instead of restoring the save."""
    manager, control = shared
    target = str(tmp_path / "in_flight")
    control.block("model")
    try:
        future = manager.save(target, _state(6.0))
        assert not future.done()
        _release_soon(control)  # while the load waits
        assert _loaded(manager, target) == 6.0
        assert future.done() and future.result() is None
    finally:
        control.reset()


def test_load_of_an_id_being_replaced_by_this_manager_restores_the_new_save(
    shared: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    """The load restored the checkpoint the id held before this manager's save of it, with no word of the newer
    save in flight: a `save(path)` then `load(path)` silently read older state."""
    manager, control = shared
    target = str(tmp_path / "replaced")
    manager.save(target, _state(1.0)).result(WAIT_S)
    control.block("model")
    try:
        future = manager.save(target, _state(2.0))
        assert not future.done()
        _release_soon(control)  # while the load waits
        assert _loaded(manager, target) == 2.0
        assert future.done()
    finally:
        control.reset()


def test_load_of_an_id_whose_save_in_flight_fails_raises_with_that_failure_and_restores_nothing(
    fresh: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, control = fresh
    target = str(tmp_path / "fails")
    manager.save(target, _state(1.0)).result(WAIT_S)
    control.block("model")  # held until the writer is killed
    future = manager.save(target, _state(2.0))
    killer = threading.Timer(0.5, os.kill, (manager.writer_pid, 9))
    killer.start()
    into = _state(-1.0)
    try:
        with pytest.raises(CheckpointError, match=r"async save of that id.*failed and committed nothing") as info:
            manager.load(target, into)
    finally:
        killer.cancel()
        control.reset()
    assert info.value.__cause__ is not None
    assert float(into["model"]["w"][0]) == -1.0  # nothing restored
    assert future.done() and future.exception() is not None
    manager.save(target, _state(3.0)).result(WAIT_S)  # the failure was seen: the next save just runs
    assert _loaded(manager, target) == 3.0


def test_load_of_another_id_does_not_wait_for_the_save_in_flight(
    shared: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, control = shared
    manager.save(str(tmp_path / "old"), _state(8.0)).result(WAIT_S)
    control.block("model")  # held until the load of "old" has returned (or WAIT_S has passed: a load that waits)
    hang_bound = threading.Timer(WAIT_S, lambda: (control.root / "block_on").unlink(missing_ok=True))
    hang_bound.start()
    try:
        future = manager.save(str(tmp_path / "new"), _state(9.0))
        assert _loaded(manager, str(tmp_path / "old")) == 8.0
        assert (control.root / "block_on").exists(), "the load of another id waited for the save in flight"
        assert not future.done()
        _release_soon(control)
        future.result(WAIT_S)
    finally:
        hang_bound.cancel()
        control.reset()


# ----------------------------------------------------------------------------------- a manager in a forked child

_FORKED = """
import os, signal, sys, threading, time
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import CheckpointError

if __name__ == "__main__":
    root = sys.argv[1]
    config = CheckpointManager.Config()
    config.save.wait_timeout_secs = 30
    manager = CheckpointManager(config)
    manager.save(f"{root}/before", {"model": {"w": torch.ones(4)}}).result(120)
    writer = manager.writer_pid
    # A parent's thread holds the manager's internal locks (its call registry, its save lock) and the staging
    # lock at the fork (internals: the only way to pin that instant); the child's copies stay held forever, and
    # the child must not wait on any of them.
    held, release = threading.Event(), threading.Event()

    def hold():
        with manager._calls, manager._saving, manager.lock():
            held.set()
            release.wait()

    threading.Thread(target=hold).start()
    held.wait()
    child = os.fork()
    release.set()
    if child == 0:
        signal.alarm(20)  # a child stuck on an inherited lock dies, and the test reads its status
        started = time.monotonic()
        for name, call in [
            ("save", lambda: manager.save(f"{root}/child", {"model": {"w": torch.zeros(4)}})),
            ("load", lambda: manager.load(f"{root}/before", {"model": {"w": torch.zeros(4)}})),
            ("lock", lambda: manager.lock()),
            ("prewarm", lambda: manager.prewarm_staging({"model": {"w": torch.zeros(4)}})),
        ]:
            try:
                call()
                print(f"child {name}: accepted", flush=True)
            except CheckpointError as exc:
                print(f"child {name}: refused: {exc}", flush=True)
        manager.close()
        print(f"child done in {time.monotonic() - started:.1f}s", flush=True)
        sys.exit(0)  # a normal exit: the interpreter's exit hooks run in the child
    _, status = os.waitpid(child, 0)
    print(f"child status {status}", flush=True)
    print(f"writer kept: {manager.writer_pid == writer}", flush=True)
    manager.save(f"{root}/after", {"model": {"w": torch.full((4,), 2.0)}}).result(30)
    print(f"writer still kept: {manager.writer_pid == writer}", flush=True)
    manager.close()
    print("entries:", sorted(os.listdir(root)), flush=True)
"""


def test_a_manager_in_a_forked_child_is_refused_and_leaves_the_parents_writer_alone(tmp_path: Path) -> None:
    done = run_script(tmp_path / "forked.py", _FORKED, str(tmp_path / "ckpt"), timeout=180)
    out = done.stdout
    for name in ("save", "load", "lock", "prewarm"):
        assert f"child {name}: refused:" in out, f"{out}\n{done.stderr}"
    assert "os.fork()" in out and "in the child" in out, out
    assert "child status 0" in out, out
    child_s = float(out.split("child done in ")[1].split("s")[0])
    assert child_s < 10, f"the child's close waited on the parent's writer:\n{out}"
    assert "writer kept: True" in out and "writer still kept: True" in out, f"{out}\n{done.stderr}"
    assert "entries: ['after', 'before']" in out, out
    assert "AssertionError" not in done.stderr, done.stderr


_CLOSE_INTERRUPTED = """
import os, signal, sys, threading, time
import torch
from tests.memory_storage import SlowCopy
from torch_checkpointing import CheckpointManager

if __name__ == "__main__":
    root = sys.argv[1]
    config = CheckpointManager.Config()
    config.save.wait_timeout_secs = 30
    manager = CheckpointManager(config)
    manager.save(f"{root}/first", {"model": {"w": torch.ones(4)}}).result(120)
    outcome = {}

    def save():
        try:
            future = manager.save(f"{root}/during", {"model": {"w": torch.full((4,), 3.0)}, "slow": SlowCopy(2.0)})
            outcome["result"] = future.result(30)
        except BaseException as exc:
            outcome["error"] = repr(exc)

    saver = threading.Thread(target=save)
    saver.start()
    while SlowCopy.copies == 0 and saver.is_alive():  # until the save is in its staging copy
        time.sleep(0.01)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        manager.close()
        print("close: returned", flush=True)
    except KeyboardInterrupt:
        print("close: interrupted", flush=True)
    saver.join(30)
    print(f"save: {outcome}", flush=True)
    writer = manager.writer_pid
    manager.close()
    state, deadline = "alive after close", time.monotonic() + 60
    while state == "alive after close" and time.monotonic() < deadline:  # its exit saves coverage data in CI
        try:
            os.kill(writer, 0)
            time.sleep(0.05)
        except ProcessLookupError:
            state = "stopped"
        except TypeError:
            state = "none"
    print(f"writer: {state}", flush=True)
"""


@pytest.mark.filterwarnings("ignore:Item 'slow' holds")
def test_ctrl_c_in_close_while_another_threads_save_runs_leaves_a_manager_that_closes_later(tmp_path: Path) -> None:
    done = run_script(tmp_path / "close_interrupted.py", _CLOSE_INTERRUPTED, str(tmp_path / "ckpt"), timeout=180)
    out = done.stdout
    assert "close: interrupted" in out, f"{out}\n{done.stderr}"
    assert "save: {'result': None}" in out, f"{out}\n{done.stderr}"
    assert "writer: stopped" in out, f"{out}\n{done.stderr}"
    assert (tmp_path / "ckpt" / "during").is_dir()


_FORKED_IN_FLIGHT = """
import os, sys, time
import torch
from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager

if __name__ == "__main__":
    root, control = sys.argv[1], Control(sys.argv[2])
    config = CheckpointManager.Config(storage_config=RecordingStorageConfig(control_dir=sys.argv[2]))
    config.save.wait_timeout_secs = 30
    manager = CheckpointManager(config)
    manager.save(f"{root}/before", {"model": {"w": torch.ones(4)}}).result(120)
    control.set_delay(1.0)
    future = manager.save(f"{root}/in_flight", {"model": {"w": torch.full((4,), 2.0)}})
    child = os.fork()
    if child == 0:
        sys.exit(0)  # at once, with the parent's save in flight: the interpreter's exit hooks run in the child
    started = time.monotonic()
    _, status = os.waitpid(child, 0)
    print(f"child exited {status} in {time.monotonic() - started:.1f}s", flush=True)
    try:
        print(f"parent save: {future.result(30)}", flush=True)
    except Exception as exc:
        print(f"parent save: {type(exc).__name__}: {exc}", flush=True)
    control.reset()
    manager.close()
"""


def test_a_forked_child_exiting_during_the_parents_save_leaves_that_save_alone(tmp_path: Path) -> None:
    args = (str(tmp_path / "ckpt"), str(tmp_path / "control"))
    done = run_script(tmp_path / "forked_in_flight.py", _FORKED_IN_FLIGHT, *args, timeout=180)
    out = done.stdout
    child_s = float(out.split(" in ")[1].split("s")[0])
    assert child_s < 10, f"the child's exit waited on the parent's save:\n{out}"
    assert "parent save: None" in out, f"{out}\n{done.stderr}"
    assert (tmp_path / "ckpt" / "in_flight" / "manifest.json").is_file()
