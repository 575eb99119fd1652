"""A config edited after it was built: checked where the manager is built, and never half-applied to a running one."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.retention import RetentionPolicy, RetentionRunner
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _ends(pid: int) -> bool:
    """Whether process `pid` ends: a stopped writer is reaped in the background, after close() returns. The
    bound only stops a hang (it exits within a second)."""
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.parametrize(
    ("edit", "error", "field"),
    [
        (
            lambda c: setattr(c.save.process_config, "subprocess_shutdown_timeout_secs", math.inf),
            ConfigError,
            "subprocess_shutdown_timeout_secs",
        ),
        (
            lambda c: setattr(c.save.process_config, "subprocess_init_timeout_secs", 0),
            ConfigError,
            "subprocess_init_timeout_secs",
        ),
        (lambda c: setattr(c.save.writer_config, "file_write_max_threads", 0), ConfigError, "file_write_max_threads"),
        (lambda c: setattr(c.save.staging_config, "use_shared_memory", "no"), ConfigTypeError, "use_shared_memory"),
        (lambda c: setattr(c.load, "use_mmap", "no"), ConfigTypeError, "use_mmap"),
    ],
)
def test_a_field_set_after_the_config_was_built_is_checked_when_the_manager_is(edit, error, field) -> None:  # type: ignore[no-untyped-def]
    config = CheckpointManager.Config.with_async_save()
    edit(config)
    with pytest.raises(error, match=field):
        CheckpointManager(config).close()  # close(): a manager built anyway (the defect) keeps no writer behind


def test_a_storage_config_field_set_after_it_was_built_is_checked_when_the_manager_is() -> None:
    storage = LocalFileSystemStorageConfig()
    storage.use_direct_io = "yes"  # type: ignore[assignment]
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = storage
    with pytest.raises(ConfigTypeError, match="use_direct_io"):
        CheckpointManager(config).close()
    with pytest.raises(ConfigTypeError, match="use_direct_io"):
        storage.create_storage()


def test_a_timeout_edited_on_a_running_manager_does_not_break_its_close(tmp_path: Path) -> None:
    manager = CheckpointManager.Config.with_async_save().build()
    manager.save(str(tmp_path / "step_1"), {"w": torch.ones(2)}).result(timeout=120)
    pid = manager.writer_pid
    assert pid is not None and _alive(pid)
    manager.config.save.process_config.subprocess_shutdown_timeout_secs = math.inf
    manager.config.save.wait_timeout_secs = math.nan
    manager.close()  # with the values it was built with
    assert _ends(pid)
    manager.close()  # a second close() of a closed manager does nothing


def test_a_users_own_post_init_is_not_run_again_when_the_manager_is_built(tmp_path: Path) -> None:
    """Only the engine's own checks run again: a user's StorageConfig subclass whose __post_init__ counts (or
    appends, or opens a client) ran it a second time at every manager built from the config."""
    runs: list[int] = []

    @dataclasses.dataclass
    class CountingConfig(LocalFileSystemStorageConfig):
        def __post_init__(self) -> None:
            super().__post_init__()
            runs.append(1)

    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = CountingConfig(use_direct_io=False)
    assert runs == [1]
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "step_1"), {"m": {"x": torch.ones(2)}})
    assert runs == [1]


def test_an_interrupt_while_close_waits_for_retention_still_stops_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() waits for the retention passes, then stops the writer. A Ctrl-C in the first wait skipped the
    second: the writer process stayed up, and the manager, marked closed, returned at a second close()."""
    before = set(threading.enumerate())
    config = CheckpointManager.Config.with_async_save()
    config.retention = RetentionPolicy(keep_last=1)
    manager = config.build()
    manager.save(str(tmp_path / "run" / "step_1"), {"w": torch.ones(2)}).result(timeout=120)
    pid = manager.writer_pid
    assert pid is not None and _alive(pid)

    real_close = RetentionRunner.close

    def interrupted(self: RetentionRunner, *args: object, **kwargs: object) -> None:
        # The runner stops its worker as a Ctrl-C in its wait has it do (a close() that only raised left the
        # worker waiting for work for the rest of the session); the Ctrl-C lands in that close() all the same.
        real_close(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(RetentionRunner, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        manager.close()
    assert _ends(pid)
    manager.close()  # closed by then: returns
    _retention_threads_end(before)


def _retention_threads_end(before: set[threading.Thread]) -> None:
    """This test's retention worker ended: one left waiting for work outlived the test (the rest of the session),
    in every later test's thread list."""
    for thread in set(threading.enumerate()) - before:
        if thread.name.startswith("ckpt-retention"):
            thread.join(60)
            assert not thread.is_alive(), f"{thread.name} outlived the test"
