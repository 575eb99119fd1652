"""What happens after a save's commit (logging, the finalize_callback) cannot fail the save or hang its Future.

Attacked for real: a `logging.Handler` whose `emit` raises (a handler over a broken socket or a full disk does)
on the `torch_checkpointing` logger, in the trainer and, installed by `subprocess_init_fn`, in the async writer
process; a `finalize_callback` that raises beside it. Before the fix a raising handler on the commit's INFO line
made a committed sync save raise, left an async save's Future unresolved forever (and the next save waited for
it until `wait_timeout_secs`), and a raising handler on a failed save's ERROR line replaced the save's own error
(sync) or hung its Future (async). The design document's rule: after the commit, a save does not fail; what
could not be logged goes to stderr.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

WAIT_S = 60.0  # also the first async save's bound, which includes spawning the writer
BROKEN = "the log handler's socket is gone"


class RaisingHandler(logging.Handler):
    """A handler whose emit raises, as a handler that does not catch its own I/O errors does."""

    def emit(self, record: logging.LogRecord) -> None:
        raise OSError(BROKEN)


def install_raising_handler(level: int = logging.INFO) -> None:
    """subprocess_init_fn: the same broken handler in the async writer process."""
    package = logging.getLogger("torch_checkpointing")
    package.setLevel(logging.INFO)
    package.addHandler(RaisingHandler(level))


def finalize_that_raises(checkpoint_dir: str, _event_logger: Any) -> None:
    raise ValueError(f"finalize failed for {checkpoint_dir}")


def pre_finalize_that_raises(checkpoint_dir: str, _event_logger: Any) -> None:
    raise ValueError(f"refused before the commit of {checkpoint_dir}")


@pytest.fixture
def raising_handler() -> Iterator[RaisingHandler]:
    package = logging.getLogger("torch_checkpointing")
    handler = RaisingHandler(logging.INFO)
    level = package.level
    package.setLevel(logging.INFO)
    package.addHandler(handler)
    try:
        yield handler
    finally:
        package.removeHandler(handler)
        package.setLevel(level)


def _manager(sync: bool, **fields: Any) -> CheckpointManager:
    config = CheckpointManager.Config.with_sync_save() if sync else CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = WAIT_S
    for name, value in fields.items():
        setattr(config, name, value)
    return CheckpointManager(config)


def _save(manager: CheckpointManager, checkpoint_id: str, value: float) -> None:
    """One save, to its end: sync returns, async waits (bounded) for the Future."""
    future = manager.save(checkpoint_id, {"w": torch.full((4,), value)})
    if future is not None:
        future.result(timeout=WAIT_S)


def _loaded(checkpoint_id: str) -> float:
    with _manager(sync=True) as reader:
        return float(reader.load(checkpoint_id, into={"w": torch.zeros(4)})["w"][0])


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_a_raising_log_handler_after_the_commit_neither_fails_nor_hangs_the_save(
    sync: bool, raising_handler: RaisingHandler, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    manager = _manager(sync)
    try:
        _save(manager, str(tmp_path / "a"), 1.0)  # before: sync raised OSError; async: TimeoutError (hung)
        _save(manager, str(tmp_path / "b"), 2.0)  # the next save is not held up by the first
    finally:
        manager.close()
    assert (_loaded(str(tmp_path / "a")), _loaded(str(tmp_path / "b"))) == (1.0, 2.0)
    err = capfd.readouterr().err
    assert BROKEN in err and "committed" in err, err  # what the handler could not log is not lost


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_a_failed_save_whose_error_line_cannot_be_logged_still_raises_its_own_error(
    sync: bool, raising_handler: RaisingHandler, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    manager = _manager(sync, pre_finalize_callback=pre_finalize_that_raises)
    try:
        with pytest.raises(ValueError, match="refused before the commit"):  # before: OSError (sync), hang (async)
            _save(manager, str(tmp_path / "a"), 1.0)
        assert not (tmp_path / "a").exists()
    finally:
        manager.close()
    with _manager(sync) as again:
        _save(again, str(tmp_path / "b"), 2.0)
    assert _loaded(str(tmp_path / "b")) == 2.0
    err = capfd.readouterr().err
    assert BROKEN in err and "failed" in err, err


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_a_raising_finalize_callback_logged_by_a_raising_handler_leaves_the_save_committed(
    sync: bool, raising_handler: RaisingHandler, tmp_path: Path
) -> None:
    """Async: the finalize_callback runs in the writer process, where subprocess_init_fn installs the handler."""
    fields: dict[str, Any] = {"finalize_callback": finalize_that_raises}
    if not sync:
        fields["subprocess_init_fn"] = install_raising_handler
    manager = _manager(sync, **fields)
    try:
        _save(manager, str(tmp_path / "a"), 1.0)  # before: the handler's OSError, though the save was committed
        _save(manager, str(tmp_path / "b"), 2.0)
    finally:
        manager.close()
    assert (_loaded(str(tmp_path / "a")), _loaded(str(tmp_path / "b"))) == (1.0, 2.0)
