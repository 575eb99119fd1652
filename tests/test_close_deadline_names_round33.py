"""close()'s WARNING for retention passes it gave up on names save.wait_timeout_secs, not what was left of it.

Round 33 made one deadline (save.wait_timeout_secs) for every wait of CheckpointManager.close(), and the
retention passes get what the waits before them left. Their WARNING then named that remainder as the timeout:
with wait_timeout_secs=2, "Retention passes did not finish within 1.9986...s of close()", a number nobody set
(the async saver's and the writer's shutdown messages already name the timeout set, not the remainder).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

_WAIT_S = 2
_HANG_S = 60.0  # only to stop a hang
_ENTERED = threading.Event()
_RELEASE = threading.Event()
_SAVER = "a-slow-save"  # the thread whose save hangs on the storage


@dataclass
class _StuckRetentionConfig(LocalFileSystemStorageConfig):
    """The local filesystem, whose listings hang on the retention thread (a store that stopped answering the
    pass) until `_RELEASE` is set. Sync saves only: the storage is built in this process."""

    def create_storage(self) -> LocalFileSystemStorage:
        return _StuckOnRetention(self)


class _StuckOnRetention(LocalFileSystemStorage):
    def ls(self, path: Path) -> list[str]:
        if threading.current_thread().name.startswith(("ckpt-retention", _SAVER)):
            _ENTERED.set()
            _RELEASE.wait(_HANG_S)
        return super().ls(path)

    def exists(self, path: Path) -> bool:
        if threading.current_thread().name == _SAVER:
            _ENTERED.set()
            _RELEASE.wait(_HANG_S)
        return super().exists(path)


def test_the_warning_names_the_timeout_set(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(wait_timeout_secs=_WAIT_S),
        storage_config=_StuckRetentionConfig(use_direct_io=False),
        retention=RetentionPolicy(keep_last=1),
    )
    _ENTERED.clear()
    _RELEASE.clear()
    manager = CheckpointManager(config)
    try:
        manager.save(str(tmp_path / "step_1"), {"m": {"x": torch.ones(2)}}, step=1)
        assert _ENTERED.wait(_HANG_S)
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            manager.close()
    finally:
        _RELEASE.set()
        manager.close()
    said = [r.getMessage() for r in caplog.records if "did not finish within" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert f"within {_WAIT_S}s (save.wait_timeout_secs) of close()" in said[0], said[0]


def test_the_error_for_a_call_still_running_names_the_timeout_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same for the ERROR about a save() on another thread that close() stopped waiting for: it named
    "1.9999...s" with wait_timeout_secs=2."""
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(wait_timeout_secs=_WAIT_S),
        storage_config=_StuckRetentionConfig(use_direct_io=False),
    )
    _ENTERED.clear()
    _RELEASE.clear()
    manager = CheckpointManager(config)
    save = threading.Thread(target=_save_quietly, args=(manager, str(tmp_path / "step_1")), name=_SAVER, daemon=True)
    save.start()
    try:
        assert _ENTERED.wait(_HANG_S)
        with caplog.at_level(logging.ERROR, logger="torch_checkpointing"):
            manager.close()
    finally:
        _RELEASE.set()
        save.join(_HANG_S)
    said = [r.getMessage() for r in caplog.records if "still running after" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert f"still running after {_WAIT_S}s (save.wait_timeout_secs);" in said[0], said[0]


def _save_quietly(manager: CheckpointManager, checkpoint_id: str) -> None:
    """A save that close() stops under it: its failure is expected, and is not this test's."""
    try:
        manager.save(checkpoint_id, {"m": {"x": torch.ones(2)}}, step=1)
    except Exception as exc:
        logging.getLogger(__name__).info("the stopped save: %r", exc)
