"""An async save's callbacks and staged values on their way to the writer process: a callable object found
picklable may stop pickling later (given a lock), and what pickles in the trainer may not unpickle in the writer (a
class it cannot import, a `__reduce__` whose load raises). Each must fail its save with an error naming what and
the fix, with no writer killed or replaced for it, and the next save must work. A request whose first writer died
before it took it must reach a second writer whole."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes import stop
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.checkpoint_process import CheckpointProcess, CheckpointProcessConfig
from torch_checkpointing.checkpoint_writer import SavePlan, WriteEntry, WriteRequest
from torch_checkpointing.config import AsyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError, ConfigTypeError, WriterProcessDied
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

WAIT_S = 120


class Callback:
    """A callable object that pickles until it is given a lock."""

    def __call__(self, path: str, metadata: Any) -> None:
        return None


def _refuse_to_load() -> Any:
    raise RuntimeError("this callback refuses to be unpickled")


class LoadsBadly:
    """Pickles in the trainer; its load raises (in the writer process)."""

    def __call__(self, path: str, metadata: Any) -> None:
        return None

    def __reduce__(self) -> Any:
        return (_refuse_to_load, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> LoadsBadly:
        return LoadsBadly()


@pytest.fixture(scope="module")
def manager() -> Iterator[CheckpointManager]:
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.items = {"extra": ItemSpec(requires_copy=True, required=False)}
    config.save.wait_timeout_secs = WAIT_S
    with CheckpointManager(config) as built:
        yield built


@pytest.fixture
def clean(manager: CheckpointManager) -> Iterator[CheckpointManager]:
    yield manager
    manager.config.finalize_callback = None
    manager.config.pre_finalize_callback = None


def _save(manager: CheckpointManager, path: Path, **extra: Any) -> None:
    future = manager.save(str(path), {"model": {"w": torch.ones(3)}, **extra})
    assert future is not None
    future.result(timeout=WAIT_S)


def test_a_callback_that_stops_pickling_after_it_was_found_picklable_is_named(
    clean: CheckpointManager, tmp_path: Path
) -> None:
    """Found picklable once, a callback was taken as picklable for good: given a lock later, its save failed with
    the bare "The checkpoint write request cannot be pickled for the async writer process", naming neither the
    callback nor the fix, and so did every later save."""
    callback = Callback()
    clean.config.finalize_callback = callback
    _save(clean, tmp_path / "a")
    callback.lock = threading.Lock()  # type: ignore[attr-defined]
    with pytest.raises(ConfigTypeError, match=r"finalize_callback cannot be pickled .*Define it at module level"):
        _save(clean, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    with pytest.raises(ConfigTypeError, match=r"finalize_callback cannot be pickled"):
        clean.save(str(tmp_path / "c"), {"model": {"w": torch.ones(3)}})  # refused in save() itself now
    del callback.lock  # type: ignore[attr-defined]
    _save(clean, tmp_path / "d")


@pytest.mark.filterwarnings("ignore:Item 'extra' holds")  # the safe-load warning of the first save of the value
@pytest.mark.parametrize("where", ["finalize_callback", "requires_copy value"])
def test_a_request_the_writer_cannot_unpickle_fails_its_save_naming_that_and_keeps_the_writer(
    clean: CheckpointManager,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer died unpickling the request (its traceback on stderr), was taken for one killed before it took
    the request, and the request went to a second writer, which died the same way: after two writer starts the
    save failed with "writer process died (exit code 1) before it took the write", naming neither the unpickling
    nor what to fix, and a warning sent the user to the OOM killer."""
    _save(clean, tmp_path / "warm")
    pid = clean.writer_pid
    extra: dict[str, Any] = {}
    if where == "finalize_callback":
        clean.config.finalize_callback = LoadsBadly()
    else:
        extra = {"extra": LoadsBadly()}
    # Every process started from now on (a writer is spawned): counted, where "< 3 s" stood for "no writer
    # started", which a busy machine's refusal alone could exceed.
    started: list[object] = []
    start = multiprocessing.context.SpawnProcess.start
    monkeypatch.setattr(
        multiprocessing.context.SpawnProcess, "start", lambda proc: (started.append(proc), start(proc))[1]
    )
    with (
        caplog.at_level(logging.WARNING, logger="torch_checkpointing"),
        pytest.raises(CheckpointError, match=r"could not be unpickled in the writer process") as raised,
    ):
        _save(clean, tmp_path / "bad", **extra)
    said = str(raised.value)
    assert "this callback refuses to be unpickled" in said, said
    assert "module level" in said and "with_sync_save()" in said, said
    assert not (tmp_path / "bad").exists()
    assert not started, "a writer was started for the request"
    assert clean.writer_pid == pid, "the writer was replaced"
    assert "OOM" not in caplog.text, caplog.text
    clean.config.finalize_callback = None
    _save(clean, tmp_path / "after")
    assert clean.writer_pid == pid


SCRIPT = """
import sys
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

if __name__ == "__main__":
    class OnlyInMain:  # the spawned writer imports this script as __mp_main__, without running this block
        def __call__(self, path, metadata):
            pass

    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.finalize_callback = OnlyInMain()
    with CheckpointManager(config) as manager:
        try:
            manager.save(sys.argv[1] + "/bad", {"w": torch.ones(2)}).result(120)
            print("SAVED")
        except Exception as exc:
            print("FAILED", type(exc).__name__, exc)
        config.finalize_callback = None
        manager.save(sys.argv[1] + "/after", {"w": torch.ones(2)}).result(120)
        print("AFTER OK")
"""


def test_a_callback_class_defined_under_the_main_guard_of_a_script_is_named(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FAILED CheckpointError" in done.stdout, (done.stdout, done.stderr[-3000:])
    assert "could not be unpickled in the writer process" in done.stdout, done.stdout
    assert "OnlyInMain" in done.stdout and "__main__" in done.stdout, done.stdout
    assert "AFTER OK" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def die_on_the_first_request(marker: str) -> None:
    """(A writer's init function.) The first writer to read a request dies reading its buffers: after it has
    unpickled the request (taking the file descriptors of its shared-memory tensors), before it says Taken."""
    import torch_checkpointing.checkpoint_process as process

    receive = process._receive_buffers

    def die_once(fd: int, message: Any) -> Any:
        if not os.path.exists(marker):
            Path(marker).touch()
            os._exit(3)
        return receive(fd, message)

    process._receive_buffers = die_once


def test_a_request_whose_first_writer_died_reading_it_is_served_by_the_second(tmp_path: Path) -> None:
    """The request went to the second writer as the same bytes, whose shared-memory tensors' file descriptors
    the first writer had taken (multiprocessing hands each out once): the second writer died unpickling it, and
    the save failed as "died before it took the write" instead of being retried."""
    marker = tmp_path / "first_died"
    process = CheckpointProcess(
        LocalFileSystemStorageConfig(use_direct_io=False),
        CheckpointProcessConfig(subprocess_init_timeout_secs=WAIT_S),
        die_on_the_first_request,
        (str(marker),),
    )
    entry = WriteEntry("w", "w_0.pt", TorchSerialization(), torch.full((2,), 7.0))
    plan = SavePlan(checkpoint_dir=str(tmp_path / "c"), tmp_dir=str(tmp_path / ".c.tmp"), rank=0, world_size=1)
    try:
        assert process.write(WriteRequest(plan, [entry])) > 0
    finally:
        process.close()
    assert marker.exists(), "the first writer did not die: the test proves nothing"
    assert torch.equal(torch.load(tmp_path / "c" / "w_0.pt"), torch.full((2,), 7.0))


def _manager_with_a_short_wait(wait_s: float) -> CheckpointManager:
    process = CheckpointProcessConfig(subprocess_shutdown_timeout_secs=2)
    return CheckpointManager(
        CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(wait_timeout_secs=wait_s, process_config=process),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _save_into_a_stopped_writer(manager: CheckpointManager, tmp_path: Path) -> tuple[int, Any]:
    """A first save done, the writer SIGSTOPped, then a save whose request waits in its pipe: (writer pid, Future)."""
    _save(manager, tmp_path / "a")
    pid = manager.writer_pid
    assert pid is not None
    stop(pid)
    future = manager.save(str(tmp_path / "b"), {"model": {"w": torch.full((3,), 2.0)}})
    assert future is not None
    return pid, future


def test_close_while_a_request_waits_unread_in_a_stopped_writers_pipe_hands_it_to_no_other_writer(
    tmp_path: Path,
) -> None:
    """close() waits for the save (save.wait_timeout_secs), then ends the stopped writer by SIGKILL: the request it
    had not taken must not go to a new writer (the engine ended that writer itself), the save must fail saying
    nothing of it was written, and close() must return within its bounds, leaving no process behind."""
    manager = _manager_with_a_short_wait(3)
    try:
        pid, future = _save_into_a_stopped_writer(manager, tmp_path)
        time.sleep(0.5)  # the request is in the stopped writer's pipe
    finally:
        started = time.monotonic()
        with contextlib.suppress(CheckpointError):  # close() re-raises the failed save's error
            manager.close()
    assert time.monotonic() - started < 30
    error = future.exception(timeout=0)
    assert isinstance(error, WriterProcessDied), error
    assert "before it took" in str(error) and "killed when a wait for the save timed out" in str(error), error
    assert manager.writer_pid is None
    assert not (tmp_path / "b").exists()
    assert not Path(f"/proc/{pid}").exists(), "the stopped writer was neither killed nor reaped"


@pytest.mark.parametrize("how", ["close()", "the next save()"])
def test_a_wait_that_timed_out_returns_with_the_killed_writes_future_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A wait that times out kills the writer and says the save was not committed; the thread that sent the
    write fails its Future once the pipe breaks. Before, close() and the next save() raised without waiting for
    that, so right after them `future.done()` was False (`future.exception(timeout=0)` raised TimeoutError) for a
    save just reported failed: the fresh-clone run of the close() test above caught it. The delay stands in for
    that thread being late (a busy machine; on several ranks, the failure agreed with the others first)."""
    manager = _manager_with_a_short_wait(2)
    saver: Any = manager._saver
    fail_unanswered = saver._fail_unanswered

    def late(*args: Any) -> None:
        time.sleep(1.0)
        fail_unanswered(*args)

    monkeypatch.setattr(saver, "_fail_unanswered", late)
    try:
        _, future = _save_into_a_stopped_writer(manager, tmp_path)
        with pytest.raises(CheckpointError, match="was not committed"):
            if how == "close()":
                manager.close()
            else:
                manager.save(str(tmp_path / "c"), {"model": {"w": torch.full((3,), 3.0)}})
        assert future.done(), "the Future of the save just reported not committed is still pending"
        assert isinstance(future.exception(timeout=0), WriterProcessDied)
    finally:
        with contextlib.suppress(CheckpointError):
            manager.close()
