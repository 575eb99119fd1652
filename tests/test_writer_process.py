"""The writer process's life: failed starts are reported and retried, a dead writer is replaced."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.probes import stop
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.checkpoint_process import CheckpointProcess, CheckpointProcessConfig
from torch_checkpointing.checkpoint_writer import SavePlan, WriteEntry, WriteRequest
from torch_checkpointing.errors import CheckpointError, WriterProcessDied
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

STORAGE = LocalFileSystemStorageConfig(use_direct_io=False)
# How long close() may take to answer on a busy machine: it sends Stop and reads the answer, a fraction of a second
# when idle.
CLOSE_BOUND_S = 60.0


def failing_init(message: str) -> None:
    raise RuntimeError(message)


def slow_init(seconds: float) -> None:
    time.sleep(seconds)


def _wait_dead(pid: int, timeout_s: float = 60) -> None:
    """Until the child `pid` can be reaped (without reaping it: multiprocessing does that). /proc shows a killed
    writer's main thread as a zombie while its other threads still exit, and until they have, the parent sees it
    alive: a save then went to its pipe and failed, where a writer dead between saves is replaced."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
        except ChildProcessError:  # reaped already
            return
        time.sleep(0.01)
    raise AssertionError(f"the killed writer {pid} had not exited after {timeout_s} s")


def _request(root: Path, name: str) -> WriteRequest:
    entry = WriteEntry("w", "w_0.pt", TorchSerialization(), torch.ones(2))
    plan = SavePlan(checkpoint_dir=str(root / name), tmp_dir=str(root / f".{name}.tmp"), rank=0, world_size=1)
    return WriteRequest(plan, [entry])


def test_a_failing_init_fn_fails_the_write_with_a_clear_error(tmp_path: Path) -> None:
    process = CheckpointProcess(
        STORAGE, CheckpointProcessConfig(subprocess_init_timeout_secs=120), failing_init, ("boom",)
    )
    try:
        with pytest.raises(
            RuntimeError,
            match=r"failed to start: subprocess_init_fn .*failing_init.* raised in the writer process: "
            r"RuntimeError: boom",
        ):
            process.write(_request(tmp_path, "c"))
        assert not (tmp_path / "c").exists()
    finally:
        process.close()


def test_a_writer_that_does_not_start_in_time_times_out(tmp_path: Path) -> None:
    process = CheckpointProcess(STORAGE, CheckpointProcessConfig(subprocess_init_timeout_secs=1), slow_init, (30.0,))
    try:
        with pytest.raises(RuntimeError, match="did not start within 1s"):
            process.write(_request(tmp_path, "c"))
    finally:
        process.close()


def _held_by_a_write(process: CheckpointProcess, timeout_s: float = 120) -> None:
    """Until a save's write holds the writer (it has sent, or is about to send, its request)."""
    deadline = time.monotonic() + timeout_s
    while not process._lock.locked():
        assert time.monotonic() < deadline, f"no write took the writer within {timeout_s} s"
        time.sleep(0.005)


@pytest.mark.parametrize("when", ["between saves", "before it takes the request"])
def test_a_killed_writer_is_replaced_for_the_next_save_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """A writer that died between saves (the OOM killer, an operator's kill) is replaced, and said so: it used to
    be restarted without a word, so a job whose writer kept being killed showed nothing.

    One killed a moment before a save (the kernel takes a while to tear a dying process down, and the trainer
    still saw it alive) failed that save with "died during the write ... may have been committed", although it
    had read nothing. It now says when it has taken a request, so one that dies before that has written nothing,
    and the request goes to a new writer, once."""
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = STORAGE
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "a"), {"w": torch.ones(3)}).result(timeout=120)  # type: ignore[union-attr]
        pid = manager.writer_pid
        assert pid is not None
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            if when == "between saves":
                os.kill(pid, signal.SIGKILL)
                _wait_dead(pid)
                future = manager.save(str(tmp_path / "b"), {"w": torch.zeros(3)})
            else:
                stop(pid)  # alive, but reads nothing: the request waits in its pipe
                future = manager.save(str(tmp_path / "b"), {"w": torch.zeros(3)})
                _held_by_a_write(manager._saver.process)
                time.sleep(0.2)  # the request is in the stopped writer's pipe (a save that found it dead passes too)
                os.kill(pid, signal.SIGKILL)
            assert future is not None
            future.result(timeout=180)
        assert manager.writer_pid not in (None, pid)
        out = manager.load(str(tmp_path / "b"), into={"w": None})
    assert torch.equal(out["w"], torch.zeros(3))
    died = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(pid) in r.getMessage()]
    assert died and "SIGKILL" in died[0], [r.getMessage() for r in caplog.records]


def die_on_every_request() -> None:
    """(A writer's init function.) The writer dies as it reads a request, before it can take it."""
    import torch_checkpointing.checkpoint_process as process

    def die(fd: int, message: object) -> None:
        os._exit(3)

    process._receive_buffers = die  # type: ignore[assignment]


def test_a_request_no_writer_takes_fails_saying_nothing_was_written(tmp_path: Path) -> None:
    """The request goes to one new writer, not forever; when that one dies before taking it too, the save fails,
    and its error says what is known: nothing of it was written."""
    process = CheckpointProcess(
        STORAGE, CheckpointProcessConfig(subprocess_init_timeout_secs=120), die_on_every_request
    )
    try:
        with pytest.raises(WriterProcessDied, match=r"before it took .*nothing of it was written") as raised:
            process.write(_request(tmp_path, "c"))
        assert raised.value.outcome_unknown is False
        assert not (tmp_path / "c").exists()
    finally:
        process.close()


class _SlowToClose(logging.Handler):
    """A log handler whose close() waits until `release` exists, then writes `marker`. The writer closes every
    handler (logging.shutdown) as it exits after answering Stop, so this holds that exit for as long as the test
    wants, like the teardown of a big slab mapping, and the marker shows the exit ran to its end."""

    def __init__(self, release: str, marker: str) -> None:
        super().__init__()
        self.release, self.marker = release, marker

    def emit(self, record: logging.LogRecord) -> None:
        pass

    def close(self) -> None:
        deadline = time.monotonic() + 2 * CLOSE_BOUND_S  # only so that a failed test leaves no writer behind
        while not Path(self.release).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(self.marker).write_text("closed")
        super().close()


def slow_exit(release: str, marker: str) -> None:
    """In the writer: exit after answering Stop only once `release` exists."""
    logging.getLogger("tests.slow_exit").addHandler(_SlowToClose(release, marker))


def test_close_does_not_wait_for_the_writers_exit_but_reaps_it(tmp_path: Path) -> None:
    release, marker = tmp_path / "release", tmp_path / "exited"
    process = CheckpointProcess(
        STORAGE, CheckpointProcessConfig(subprocess_init_timeout_secs=120), slow_exit, (str(release), str(marker))
    )
    assert process.write(_request(tmp_path, "c")) > 0
    pid = process.pid
    assert pid is not None
    closing = threading.Thread(target=process.close)
    closing.start()
    closing.join(CLOSE_BOUND_S)  # the writer cannot exit before `release` exists, made only after close() returns
    returned, held = not closing.is_alive(), not marker.exists()
    release.touch()
    closing.join(CLOSE_BOUND_S)
    assert returned, "close() waited for the writer's exit"
    assert held, "the writer exited before it was let: the test proves nothing"
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # a zombie keeps its /proc entry
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the writer was not reaped"
    assert marker.read_text() == "closed", "the writer did not finish its exit"


def test_close_kills_a_writer_that_does_not_answer_stop(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    process = CheckpointProcess(
        STORAGE, CheckpointProcessConfig(subprocess_init_timeout_secs=120, subprocess_shutdown_timeout_secs=1)
    )
    assert process.write(_request(tmp_path, "c")) > 0
    pid = process.pid
    assert pid is not None
    stop(pid)  # alive, never answers; only SIGKILL can end it now
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        process.close()
    assert not Path(f"/proc/{pid}").exists(), "the stopped writer was neither killed nor reaped"
    assert f"checkpoint writer process {pid} did not exit within 1s; killing it" in caplog.text


def test_a_writer_started_after_the_working_directory_was_deleted_names_that(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer is spawned in the working directory. One deleted after the program changed into it failed the
    spawn with "failed to start: FileNotFoundError ... guard your script's entry point with if __name__ ==
    '__main__'", which was not the cause. The error now names it and its fix, and the writer starts once there
    is a working directory again."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    process = CheckpointProcess(STORAGE, CheckpointProcessConfig(subprocess_init_timeout_secs=120))
    try:
        with pytest.raises(CheckpointError, match=r"working directory of this process no longer exists") as raised:
            process.write(_request(tmp_path, "c"))
        assert "__main__" not in str(raised.value)
        assert "os.chdir()" in str(raised.value)
        # A restart right after the failure (as after other failed starts) failed again before the caller could
        # chdir, and the save after the fix got the same error; the wait lets such a restart happen first.
        time.sleep(0.5)
        monkeypatch.chdir(tmp_path)
        assert process.write(_request(tmp_path, "c")) > 0
    finally:
        process.close()
    assert (tmp_path / "c").is_dir()


@pytest.mark.parametrize("taken", [False, True])
def test_a_dead_writer_is_described_alike_before_and_after_it_took_the_write(taken: bool) -> None:
    """One sentence describes a writer that died under a save, both before it took the request and after: the
    pid and how it ended (the signal's name and its exit code) in both, and only what became of the save apart.
    Before, the two were separate copies, and the one after named neither the pid nor the signal."""
    from torch_checkpointing.checkpoint_process import _death_message

    said = _death_message(4242, -9, "/ck/b", taken=taken, stopped_by=None)
    where = "during the write of" if taken else "before it took the write of"
    assert said.startswith(f"Checkpoint writer process 4242 died {where} /ck/b (killed by SIGKILL, exit code -9)")
    assert said.endswith("It is restarted for the next save."), said
    fate = "or this one if the writer died right after committing it" if taken else "nothing of it was written"
    assert fate in said, said
    stopped = _death_message(4242, 3, "/ck/b", taken=taken, stopped_by="close()")
    assert "(exit code 3)" in stopped and stopped.endswith("It was stopped by close()."), stopped
    timed_out = _death_message(4242, -9, "/ck/b", taken=taken, stopped_by="timeout")
    assert timed_out.endswith("It was killed when a wait for the save timed out (save.wait_timeout_secs)."), timed_out
