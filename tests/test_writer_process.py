"""The writer process's life: failed starts are reported and retried, a dead writer is replaced."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.checkpoint_process import CheckpointProcess, CheckpointProcessConfig
from torch_checkpointing.checkpoint_writer import WriteEntry, WriteRequest
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

STORAGE = LocalFileSystemStorageConfig(use_direct_io=False)


def failing_init(message: str) -> None:
    raise RuntimeError(message)


def slow_init(seconds: float) -> None:
    time.sleep(seconds)


def _request(root: Path, name: str) -> WriteRequest:
    entry = WriteEntry("w", "w_0.pt", TorchSerialization(), torch.ones(2))
    return WriteRequest(str(root / name), str(root / f".{name}.tmp"), 0, 1, [entry])


def test_a_failing_init_fn_fails_the_write_with_a_clear_error(tmp_path: Path) -> None:
    process = CheckpointProcess(
        STORAGE, CheckpointProcessConfig(subprocess_init_timeout_secs=120), failing_init, ("boom",)
    )
    try:
        with pytest.raises(RuntimeError, match="writer process failed to start.*__main__"):
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


def test_a_writer_killed_between_saves_is_replaced(tmp_path: Path) -> None:
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = STORAGE
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "a"), {"w": torch.ones(3)}).result(timeout=120)  # type: ignore[union-attr]
        pid = manager.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        manager.save(str(tmp_path / "b"), {"w": torch.zeros(3)}).result(timeout=180)  # type: ignore[union-attr]
        assert manager.writer_pid not in (None, pid)
        out = manager.load(str(tmp_path / "b"), into={"w": None})
    assert torch.equal(out["w"], torch.zeros(3))


def slow_exit(seconds: float) -> None:
    """In the writer: take `seconds` to exit after answering Stop, like the teardown of a big slab mapping."""
    from torch_checkpointing import checkpoint_process

    exit_now = checkpoint_process._exit_now

    def slow() -> None:
        time.sleep(seconds)
        exit_now()

    checkpoint_process._exit_now = slow


def test_close_does_not_wait_for_the_writers_exit_but_reaps_it(tmp_path: Path) -> None:
    process = CheckpointProcess(STORAGE, CheckpointProcessConfig(subprocess_init_timeout_secs=120), slow_exit, (3.0,))
    assert process.write(_request(tmp_path, "c")) > 0
    proc = process._proc
    assert proc is not None
    t0 = time.monotonic()
    process.close()
    assert time.monotonic() - t0 < 1.5, "close() waited for the writer's exit"
    deadline = time.monotonic() + 60
    while Path(f"/proc/{proc.pid}").exists() and time.monotonic() < deadline:  # a zombie keeps its /proc entry
        time.sleep(0.1)
    assert not Path(f"/proc/{proc.pid}").exists(), "the writer was not reaped"
    assert proc.exitcode == 0


def test_close_kills_a_writer_that_does_not_answer_stop(tmp_path: Path) -> None:
    process = CheckpointProcess(
        STORAGE, CheckpointProcessConfig(subprocess_init_timeout_secs=120, subprocess_shutdown_timeout_secs=1)
    )
    assert process.write(_request(tmp_path, "c")) > 0
    proc = process._proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)  # alive, never answers
    process.close()
    assert not proc.is_alive() and proc.exitcode == -signal.SIGKILL
