"""close()'s waits derive from the user's settings: a second close() waits for the first as long as that one can take.

A close() called while another thread's is under way waits for it, bounded by what the first can still take:
what is left of save.wait_timeout_secs, then the writer's shutdown (subprocess_shutdown_timeout_secs, and the
kill of a writer that does not answer). It allowed a fixed 10 s past the first's timeouts; now the allowance is
the saver's own stated bound. Outcomes are checked, not durations: the writer is SIGSTOPped (a real process that
ignores Stop), so the first close() waits the whole shutdown timeout, past the second's wait_timeout_secs, and
kills it; the second must return only once that is done, without saying it gave up.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import pytest
import torch

from tests.probes import stop
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_process import KILLED_EXIT_S
from torch_checkpointing.checkpoint_saver import _FUTURE_AFTER_KILL_S
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

_WAIT_S = 1  # save.wait_timeout_secs
_SHUTDOWN_S = 4  # subprocess_shutdown_timeout_secs: past _WAIT_S, so the first close() outlasts it
_HANG_S = 120.0  # only to stop a hang


def _manager() -> CheckpointManager:
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = _WAIT_S
    config.save.process_config.subprocess_shutdown_timeout_secs = _SHUTDOWN_S
    return CheckpointManager(config)


def test_the_stated_bound_is_the_shutdown_timeout_and_the_kills() -> None:
    manager = _manager()
    try:
        assert manager._saver.close_bound_s() == _FUTURE_AFTER_KILL_S + _SHUTDOWN_S + 3 * KILLED_EXIT_S
    finally:
        manager.close()


def test_a_second_close_waits_for_the_first_one_stopping_a_writer_that_ignores_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = _manager()
    manager.save(str(tmp_path / "step_1"), {"m": {"x": torch.ones(2)}}, step=1).result(_HANG_S)
    proc = manager._saver.process._proc
    stop(proc.pid)
    entered = threading.Event()
    real_close = manager._saver.process.close

    def close_noting_entry() -> None:
        entered.set()
        real_close()

    manager._saver.process.close = close_noting_entry  # type: ignore[method-assign]
    first = threading.Thread(target=manager.close, name="first-close")
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        first.start()
        assert entered.wait(_HANG_S)  # the first close() is stopping the writer
        second = threading.Thread(target=manager.close, name="second-close")
        second.start()
        second.join(_HANG_S)
        assert not second.is_alive()
        writer_ended = proc.exitcode  # read as the second close() returned
        first.join(_HANG_S)
    assert writer_ended == -signal.SIGKILL, "the second close() returned before the first had stopped the writer"
    assert not [r for r in caplog.records if "returning without it" in r.getMessage()], caplog.text
    assert [r for r in caplog.records if "did not exit within" in r.getMessage()], caplog.text
