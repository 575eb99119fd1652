"""A timeout given to a wait on several things is one total deadline, as `Future.result`'s is (round 33).

`RetentionRunner.wait(timeout)` and `close(timeout)` gave each pending pass the whole timeout: with passes
ending one after the other, just inside each one's own timeout, the call took up to N x timeout, and returned
as if on time. Now the passes share one deadline: a pass still pending when it has passed is a TimeoutError
(`wait`) or a logged WARNING (`close`).

Outcomes, not durations, are checked: pass A ends at 0.5 x the timeout and pass B at 1.33 x, so a wait bounded
by the timeout gives up on B, and one that gave B a fresh timeout after A saw it end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.probes import stop
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy, RetentionRunner
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

_TIMEOUT_S = 3.0
_A_ENDS_S = 1.5  # within the timeout
_B_ENDS_S = 4.0  # past it, yet within A's end + a fresh timeout (4.5 s)
_HANG_S = 60.0  # only to stop a hang


def _runner_with_two_passes(tmp_path: str) -> tuple[RetentionRunner, list[threading.Timer]]:
    """Two passes pending on two async saves' writes; a failed write ends its pass at once (it deletes nothing),
    at `_A_ENDS_S` and `_B_ENDS_S` from now."""
    runner = RetentionRunner(RetentionPolicy(keep_last=1), rank=0)
    timers = []
    for i, when in enumerate((_A_ENDS_S, _B_ENDS_S)):
        write: Future[object] = Future()
        runner.after_commit(f"{tmp_path}/step_{i}", write)
        timers.append(threading.Timer(when, write.set_exception, (OSError("the save failed"),)))
    for timer in timers:
        timer.start()
    return runner, timers


def _bounded(call: Callable[[], object], hang_s: float = _HANG_S) -> BaseException | None:
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(hang_s)
    assert outcome, "the wait hung"
    return outcome[0]


def test_wait_gives_up_once_its_timeout_has_passed_in_all(tmp_path: Path) -> None:
    """Defect: wait(3) returned after 4 s, pass A having taken 1.5 s of its timeout and B 2.5 s of a fresh one."""
    runner, timers = _runner_with_two_passes(str(tmp_path))
    try:
        raised = _bounded(lambda: runner.wait(_TIMEOUT_S))
        assert isinstance(raised, TimeoutError), f"wait({_TIMEOUT_S}) waited for a pass ending at {_B_ENDS_S} s"
    finally:
        for timer in timers:
            timer.join()
        runner.close()


def test_close_gives_up_once_its_timeout_has_passed_in_all(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    runner, timers = _runner_with_two_passes(str(tmp_path))
    try:
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            assert _bounded(lambda: runner.close(_TIMEOUT_S)) is None
        assert any("did not finish within" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        for timer in timers:
            timer.join()


class _StuckListing(LocalFileSystemStorage):
    """The local filesystem, whose listing hangs (a store that stopped answering) until `release` is set."""

    def __init__(self) -> None:
        super().__init__(LocalFileSystemStorageConfig(use_direct_io=False))
        self.entered = threading.Event()
        self.release = threading.Event()

    def ls(self, path: Path) -> list[str]:
        self.entered.set()
        self.release.wait(_HANG_S)
        return super().ls(path)


def test_close_returns_at_its_timeout_while_a_pass_hangs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Defect: close(1) logged "did not finish within 1s", then joined the pass's thread, for as long as the pass
    hung (a store that stopped answering). It now leaves the pass's (daemon) thread to end on its own."""
    (tmp_path / "step_1").mkdir()
    storage = _StuckListing()
    runner = RetentionRunner(RetentionPolicy(keep_last=1), rank=0, storage=storage)
    try:
        runner.after_commit(str(tmp_path / "step_1"), None)
        assert storage.entered.wait(_HANG_S)
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            outcome = _bounded(lambda: runner.close(1.0), hang_s=_HANG_S / 2)
        assert outcome is None
        assert any("did not finish within" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        storage.release.set()


@dataclass
class _StuckRetentionConfig(LocalFileSystemStorageConfig):
    """The local filesystem, whose listings hang on the retention thread (a store that stopped answering the
    pass), until `_STUCK.release` is set. Sync saves only: the storage is built in this process."""

    def create_storage(self) -> LocalFileSystemStorage:
        return _StuckOnRetention(self)


class _StuckOnRetention(LocalFileSystemStorage):
    def ls(self, path: Path) -> list[str]:
        if threading.current_thread().name.startswith("ckpt-retention"):
            _STUCK.entered.set()
            _STUCK.release.wait(_HANG_S)
        return super().ls(path)


class _Stuck:
    entered = threading.Event()
    release = threading.Event()


_STUCK = _Stuck()


def test_manager_close_is_bounded_by_wait_timeout_secs_while_a_retention_pass_hangs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: close() with save.wait_timeout_secs=1 waited for the hung retention pass up to RetentionRunner's
    own 600 s (and, before this round, for as long as it hung)."""
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(wait_timeout_secs=1),
        storage_config=_StuckRetentionConfig(use_direct_io=False),
        retention=RetentionPolicy(keep_last=1),
    )
    _STUCK.entered.clear()
    _STUCK.release.clear()
    manager = CheckpointManager(config)
    try:
        manager.save(str(tmp_path / "step_1"), {"m": {"x": torch.ones(2)}}, step=1)
        assert _STUCK.entered.wait(_HANG_S)
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            assert _bounded(manager.close, hang_s=_HANG_S / 2) is None
        assert any("did not finish within" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        _STUCK.release.set()
        manager.close()


_SHUTDOWN_S = 3  # CheckpointProcessConfig.subprocess_shutdown_timeout_secs
_CONTINUED_S = 4.5  # past it, yet within the Stop's wait + a fresh timeout for the join (6 s)


def test_the_writers_shutdown_is_bounded_by_its_timeout_in_all(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: close() waited subprocess_shutdown_timeout_secs for the writer to answer Stop, then as long again
    for it to exit: a writer SIGSTOPped, continued at 1.5 x the timeout, answered and exited on its own, where
    the timeout had passed and it is killed."""
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.process_config.subprocess_shutdown_timeout_secs = _SHUTDOWN_S
    manager = CheckpointManager(config)
    manager.save(str(tmp_path / "step_1"), {"m": {"x": torch.ones(2)}}, step=1).result(_HANG_S)
    proc = manager._saver.process._proc
    stop(proc.pid)
    timer = threading.Timer(_CONTINUED_S, _continue, (proc.pid,))
    timer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            assert _bounded(manager.close) is None
        timer.join()
        proc.join(_HANG_S)
        assert proc.exitcode == -signal.SIGKILL, proc.exitcode
        assert any("did not exit within" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        timer.cancel()
        _continue(proc.pid)


def _continue(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # killed and reaped by then
        os.kill(pid, signal.SIGCONT)
