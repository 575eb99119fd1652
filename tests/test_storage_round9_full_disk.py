"""Local filesystem storage on a real small filesystem: the overwrite of an id, and a root that cannot be written.

The disk-full tests in tests/test_storage_faults.py save a new id; here the save that runs out of space
replaces an existing checkpoint of the same id (the overwrite policy of docs/durability.md: the old one stays
until the new one is complete), on tmpfs (buffered writes) and on an ext4 loop image (O_DIRECT writes). A root
on a read-only mount fails with the path named and changes nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_storage_faults import _digest, _mount_ext4, _mount_tmpfs, _umount
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

RESULT_TIMEOUT = 120
SMALL = {"model": {"w": torch.arange(1000.0)}}


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "small"
    reason = _mount_tmpfs(where, "8m") if request.param == "tmpfs" else _mount_ext4(where, tmp_path / "ext4.img")
    if reason is not None:
        pytest.skip(f"cannot mount a small {request.param} ({reason})")
    try:
        yield where
    finally:
        _umount(where)


def _manager(mode: str) -> CheckpointManager:
    save = AsyncCheckpointSaverConfig() if mode == "async" else SyncCheckpointSaverConfig()
    storage = LocalFileSystemStorageConfig(use_direct_io=True)
    return CheckpointManager(CheckpointManager.Config(save=save, storage_config=storage))


def _result(fut: Future[Any] | None) -> None:
    if fut is not None:
        fut.result(timeout=RESULT_TIMEOUT)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_overwrite_that_fills_the_disk_keeps_the_earlier_checkpoint_of_that_id(
    small_fs: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = _manager(mode)
    try:
        ckpt = os.fspath(small_fs / "step_1")
        _result(manager.save(ckpt, SMALL))
        before = _digest(small_fs)
        caplog.set_level(logging.WARNING, logger="torch_checkpointing")
        with pytest.raises(OSError) as info:
            _result(manager.save(ckpt, {"model": {"w": torch.randn(4_000_000)}}))
        assert info.value.errno == errno.ENOSPC and os.fspath(small_fs) in (info.value.filename or ""), info.value
        assert _digest(small_fs) == before  # the old checkpoint under its id, byte for byte; no temporaries
        out = manager.load(ckpt, into={"model": {"w": torch.zeros(1000)}})
        assert torch.equal(out["model"]["w"], SMALL["model"]["w"])
        assert "step_1" in caplog.text  # the failure is logged, naming the id
    finally:
        manager.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_root_on_a_read_only_filesystem_fails_naming_the_path_and_the_manager_goes_on(
    tmp_path: Path, mode: str
) -> None:
    where = tmp_path / "ro"
    reason = _mount_tmpfs(where, "8m")
    if reason is not None:
        pytest.skip(f"cannot mount a tmpfs ({reason})")
    try:
        manager = _manager(mode)
        try:
            _result(manager.save(os.fspath(where / "step_1"), SMALL))
            subprocess.run(["mount", "-o", "remount,ro", os.fspath(where)], check=True, timeout=30)
            before = _digest(where)
            for ckpt in (where / "step_2", where / "runs" / "step_2"):  # the root itself, and a parent to create
                with pytest.raises(OSError) as info:
                    _result(manager.save(os.fspath(ckpt), SMALL))
                assert info.value.errno == errno.EROFS and os.fspath(where) in (info.value.filename or "")
            assert _digest(where) == before
            _result(manager.save(os.fspath(tmp_path / "elsewhere"), SMALL))  # the manager is still usable
            out = manager.load(os.fspath(where / "step_1"), into={"model": {"w": torch.zeros(1000)}})
            assert torch.equal(out["model"]["w"], SMALL["model"]["w"])
        finally:
            manager.close()
    finally:
        _umount(where)
