"""Saves never lose data, with real processes and signals: orphaned writers, stuck writers, silent failures, Ctrl-C.

Every child process and wait is bounded; writers stopped or orphaned by a test are killed in `finally`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import Control, RecordingStorageConfig
from tests.probes import stop
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, RawSerialization
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT = 120


def _child(function: str, *args: Any, new_session: bool = False) -> subprocess.Popen[str]:
    code = f"from tests.safe_save_trainers import {function}; {function}(*{args!r})"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def _kill(pid: int | None) -> None:
    if pid is not None and not _gone(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def control(tmp_path: Path) -> Iterator[Control]:
    ctl = Control(tmp_path / "control")
    yield ctl
    ctl.reset()


def _sync() -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(), storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
        )
    )


def _value(manager: CheckpointManager, target: Path) -> float:
    return float(manager.load(str(target), into={"model": {"w": torch.zeros(8)}})["model"]["w"][0])


# ---------------------------------------------------------------------------------------- orphaned writer (6)


def test_an_orphaned_writer_never_commits_over_a_newer_save(control: Control, tmp_path: Path) -> None:
    # Before: trainer A SIGKILLed mid-write; B saved the same id; A's writer then finished and swapped stale data in.
    target = tmp_path / "ck"
    control.block("model_0.pt")
    trainer = _child("async_save_then_wait", str(control.root), str(target), 1.0)
    writer = None
    try:
        writer = control.wait_blocked(CHILD_TIMEOUT)
        trainer.kill()
        trainer.wait(CHILD_TIMEOUT)
        assert _wait_gone(writer, 60), "the writer outlived its trainer"
        manager = _sync()
        try:
            manager.save(str(target), {"model": {"w": torch.full((8,), 2.0)}})
            control.reset()  # were the orphan alive, it would now finish and commit A's data
            time.sleep(1.0)
            assert _value(manager, target) == 2.0
        finally:
            manager.close()
    finally:
        control.reset()
        trainer.kill()
        _kill(writer)


# -------------------------------------------------------------------------------------- stuck writer (7)


def test_close_is_bounded_on_a_stopped_writer(control: Control, tmp_path: Path) -> None:
    # Before: close() was still blocked after 20 s (it joined a thread stuck in an unbounded recv()).
    manager = CheckpointManager(
        CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(wait_timeout_secs=3),
            storage_config=RecordingStorageConfig(control_dir=str(control.root)),
        )
    )
    control.block("model_0.pt")
    future = manager.save(str(tmp_path / "ck"), {"model": {"w": torch.ones(8)}})
    writer = control.wait_blocked(CHILD_TIMEOUT)
    outcome: list[BaseException | None] = []
    try:
        stop(writer)
        control.reset()

        def close() -> None:
            try:
                manager.close()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        started = time.monotonic()
        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() hung on a stopped writer"
        assert time.monotonic() - started < 20
    finally:
        _kill(writer)
    assert isinstance(outcome[0], CheckpointError), outcome
    assert "did not finish within 3" in str(outcome[0]) and "killed" in str(outcome[0])
    with pytest.raises(CheckpointError):
        future.result(timeout=5)
    assert not (tmp_path / "ck").exists()


def test_interpreter_exit_is_bounded_on_a_stopped_writer(control: Control, tmp_path: Path) -> None:
    # Before: the interpreter never exited (it joined the executor thread stuck in recv()).
    control.block("model_0.pt")
    trainer = _child("async_save_stop_writer_and_exit", str(control.root), str(tmp_path / "ck"))
    hung = False
    try:
        out, err = trainer.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        hung = True
        trainer.kill()
        out, err = trainer.communicate(timeout=30)
    lines = out.splitlines()
    writer = json.loads(lines[-1])["writer"] if lines else None
    try:
        assert not hung, "the trainer did not exit with its writer stopped"
        assert writer is not None and _wait_gone(writer, 60), ("the stopped writer was left behind", err)
    finally:
        _kill(writer)


# -------------------------------------------------------------------------------- failed async saves (8)


def test_a_failed_async_save_is_logged_and_surfaced_by_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: a failed save whose Future nobody checked left no exception, warning or log.
    items = {"raw": ItemSpec(requires_copy=False, layout=LayoutInfo("raw.bin", RawSerialization()))}
    manager = CheckpointManager(
        CheckpointManager.Config(
            items=items,
            save=AsyncCheckpointSaverConfig(wait_timeout_secs=120),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )
    try:
        with caplog.at_level(logging.INFO, logger="torch_checkpointing"):
            manager.save(str(tmp_path / "step_1"), {"raw": b"ok"}).result(timeout=120)
            manager.save(str(tmp_path / "step_2"), {"raw": "not bytes"})  # the Future is dropped, as in the README
            with pytest.raises(CheckpointError, match=r"save of .*step_2 failed.*RawSerialization requires bytes"):
                manager.save(str(tmp_path / "step_3"), {"raw": b"ok"})
            manager.save(str(tmp_path / "step_3"), {"raw": b"ok"}).result(timeout=120)  # surfaced once
            failed = manager.save(str(tmp_path / "step_4"), {"raw": "not bytes"})
            with pytest.raises(ValueError):
                failed.result(timeout=120)
            manager.save(str(tmp_path / "step_5"), {"raw": b"ok"}).result(timeout=120)  # already seen: not raised
            manager.save(str(tmp_path / "step_6"), {"raw": "not bytes"})
            with pytest.raises(CheckpointError, match="step_6 failed"):
                manager.close()
    finally:
        manager.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("step_2 failed" in m for m in errors) and any("step_6 failed" in m for m in errors), errors
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "committed" in r.getMessage()]
    assert any("step_1" in m and "bytes" in m and "blocked" in m and "MB/s" in m for m in infos), infos
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_3", "step_5"]


# ------------------------------------------------------------------------------------------------- Ctrl-C (12)


def test_ctrl_c_leaves_the_async_writer_to_finish_the_save(control: Control, tmp_path: Path) -> None:
    # Before: the writer died with the trainer's SIGINT and the in-flight save was lost.
    target = tmp_path / "ck"
    control.block("model_0.pt")
    trainer = _child("async_save_then_wait", str(control.root), str(target), 1.0, new_session=True)
    writer = None
    try:
        writer = control.wait_blocked(CHILD_TIMEOUT)
        os.killpg(trainer.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
        time.sleep(1.0)
        assert not _gone(writer), "the writer died with the terminal's SIGINT"
        control.reset()
        trainer.communicate(timeout=90)
    finally:
        control.reset()
        trainer.kill()
        _kill(writer)
    manager = _sync()
    try:
        assert _value(manager, target) == 1.0
    finally:
        manager.close()


def test_ctrl_c_during_a_sync_save_says_interrupted(control: Control, tmp_path: Path) -> None:
    # Before: a RuntimeError from inline_container.cc, which reads like disk corruption.
    target = tmp_path / "out" / "ck"
    target.parent.mkdir()
    control.block("model_0.pt")
    trainer = _child("sync_save_interrupted", str(control.root), str(target), new_session=True)
    try:
        pid = control.wait_blocked(CHILD_TIMEOUT)
        assert pid == trainer.pid
        os.killpg(trainer.pid, signal.SIGINT)
        out, err = trainer.communicate(timeout=60)
    finally:
        control.reset()
        trainer.kill()
    seen = json.loads(out.splitlines()[-1])
    assert seen["type"] == "KeyboardInterrupt" and "interrupted" in seen["message"], (seen, err)
    assert "nothing was committed" in seen["message"]
    assert seen["left"] == [], "the interrupted save left a temporary directory"
