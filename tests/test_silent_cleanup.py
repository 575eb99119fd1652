"""Cleanups that fail are heard: a folder that refuses removals (append-only, `chattr +a`: a real kernel refusal,
also for root) leaves what a failed operation could not remove, and the user is told which path and what to do."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.hf import export_hf


@pytest.fixture
def append_only(tmp_path: Path) -> Iterator[Path]:
    """A directory whose entries can be created but not renamed away or removed."""
    folder = tmp_path / "append-only"
    folder.mkdir()
    try:
        done = subprocess.run(["chattr", "+a", str(folder)], capture_output=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no chattr on this machine")
    if done.returncode != 0:
        pytest.skip(f"chattr +a refused here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-a", str(folder)], check=True, timeout=30)


def test_an_export_that_cannot_be_published_names_the_folder_and_its_staging_left(
    tmp_path: Path, append_only: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = CheckpointManager(CheckpointManager.Config.with_sync_save())
    mgr.save(str(tmp_path / "ck"), {"model": {"w": torch.randn(64, 64)}})
    mgr.close()
    out = append_only / "hf"
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"), pytest.raises(OSError) as info:
        export_hf(str(tmp_path / "ck"), "model", str(out))
    assert str(out) in str(info.value) and "export again" in str(info.value)
    assert not out.exists()
    (left,) = list(append_only.iterdir())  # the staging directory could not be removed from this folder
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(left) in m and "Delete it" in m for m in warned), warned
