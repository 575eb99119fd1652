"""Async lifecycle defects found in round 15, each with the test that failed before its fix.

* A stopped (SIGSTOP) or hung writer process refused every later save until close(): the save after it waited
  `wait_timeout_secs` and raised "refusing to start another", and so did every save after that, because
  nothing ended the writer (wait() kills it on the same timeout; the next save did not).
* `CheckpointProcessConfig` accepted writer timeouts past the longest wait a pipe's poll() takes (about 24.8
  days): close() then raised a bare OverflowError and left the writer running, and every save failed with
  "the writer failed to start ... guard your entry point", which was not the fix.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointProcessConfig
from torch_checkpointing.errors import CheckpointError, ConfigError


def test_a_stopped_writer_is_killed_by_the_next_saves_timeout_and_the_save_after_works(tmp_path: Path) -> None:
    config = CheckpointManager.Config(save=AsyncCheckpointSaverConfig(wait_timeout_secs=3))
    with CheckpointManager(config) as manager:
        first = manager.save(str(tmp_path / "a"), {"m": {"w": torch.ones(4)}})
        assert first is not None
        first.result(timeout=120)
        pid = manager.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            stuck = manager.save(str(tmp_path / "b"), {"m": {"w": torch.full((4,), 2.0)}})
            with pytest.raises(CheckpointError, match=r"killed"):
                manager.save(str(tmp_path / "c"), {"m": {"w": torch.full((4,), 3.0)}})
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert stuck is not None and stuck.exception(timeout=60) is not None  # it resolves: not committed
        again = manager.save(str(tmp_path / "c"), {"m": {"w": torch.full((4,), 3.0)}})  # a new writer
        assert again is not None
        again.result(timeout=120)
        assert torch.equal(manager.load(str(tmp_path / "c"))["m"]["w"], torch.full((4,), 3.0))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("field", ["subprocess_init_timeout_secs", "subprocess_shutdown_timeout_secs"])
@pytest.mark.parametrize("value", [3e6, 1e308])
def test_a_writer_timeout_no_os_wait_takes_is_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        CheckpointProcessConfig(**{field: value})


def test_a_writer_timeout_of_three_weeks_is_taken() -> None:
    config = CheckpointProcessConfig(subprocess_init_timeout_secs=21 * 86400, subprocess_shutdown_timeout_secs=1800)
    assert config.subprocess_init_timeout_secs == 21 * 86400
