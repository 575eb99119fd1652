"""close() keeps to the bound docs/guide.md states ("What `close()` waits for"), whatever the writer leaves behind.

Attacked for real: a `subprocess_init_fn` that forks a helper process (a metrics agent, a storage daemon) which
inherits every descriptor of the writer process, the ends of its pipes included, and outlives it. A killed writer
then neither closes its pipe nor its process sentinel, so every wait on them runs to its full timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from torch_checkpointing.checkpoint_process import CheckpointProcess, CheckpointProcessConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

STARTED_S = 300.0  # the spawned writer imports torch: minutes on a loaded two-core machine, never a bound
HANG_S = 3600.0
# close()'s bound here is 1 s + 2 x 5 s (`shutdown_bound_s`); ten times that only stops a hang
CLOSE_HANG_S = 10 * (1 + 2 * 5.0)


def fork_a_helper_then_take_long(marker: str) -> None:
    """subprocess_init_fn: a forked helper holding the writer's descriptors, then an init that takes an hour."""
    helper = os.fork()
    if helper == 0:
        time.sleep(HANG_S)
        os._exit(0)
    Path(marker).write_text(str(helper))
    time.sleep(HANG_S)


def _wait_for(marker: Path) -> int:
    end = time.monotonic() + STARTED_S
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < end, "the writer never ran subprocess_init_fn: the test proves nothing"
        time.sleep(0.1)
    return int(marker.read_text())


def test_close_during_a_slow_init_keeps_to_its_bound_though_a_helper_holds_the_writers_pipes(
    tmp_path: Path,
) -> None:
    """Before: close() killed the starting writer, then waited `subprocess_init_timeout_secs` (here an hour) for
    the start to report, as the helper kept the pipe open: far past `shutdown_bound_s`."""
    marker = tmp_path / "helper_pid"
    process = CheckpointProcess(
        LocalFileSystemStorageConfig(use_direct_io=False),
        CheckpointProcessConfig(subprocess_init_timeout_secs=HANG_S, subprocess_shutdown_timeout_secs=1),
        fork_a_helper_then_take_long,
        (str(marker),),
    )
    helper = _wait_for(marker)
    closer = threading.Thread(target=process.close, daemon=True)
    try:
        closer.start()
        closer.join(CLOSE_HANG_S)
        assert not closer.is_alive(), (
            f"close() still running after {CLOSE_HANG_S}s (bound {process.shutdown_bound_s()}s)"
        )
    finally:
        os.kill(helper, signal.SIGKILL)  # lets a close() still waiting end
        closer.join(CLOSE_HANG_S)


def test_close_that_gives_up_on_a_start_says_how_long_it_waited(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its WARNING said the start "did not end within 5.0s of being killed" (`KILLED_EXIT_S`), after a wait of
    `subprocess_shutdown_timeout_secs` and 5 s more."""
    marker = tmp_path / "helper_pid"
    process = CheckpointProcess(
        LocalFileSystemStorageConfig(use_direct_io=False),
        CheckpointProcessConfig(subprocess_init_timeout_secs=HANG_S, subprocess_shutdown_timeout_secs=3),
        fork_a_helper_then_take_long,
        (str(marker),),
    )
    helper = _wait_for(marker)
    try:
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            process.close()
    finally:
        os.kill(helper, signal.SIGKILL)
    said = [r.getMessage() for r in caplog.records if "being started" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "within 8s" in said[0] and "subprocess_shutdown_timeout_secs" in said[0], said[0]
