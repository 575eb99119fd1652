"""Engine leftovers: `~` in the staging directory, and the build-time check of long file names at the
largest rank of the world."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager


def test_staging_dir_with_a_tilde_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every other path argument expands `~`; the staging directory was taken literally (FileNotFoundError
    naming '~/stg', or a slab in a './~' directory where one existed)."""
    monkeypatch.setenv("HOME", os.fspath(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stg").mkdir()
    stager = DefaultStager(CheckpointStagerConfig(staging_dir="~/stg"))
    try:
        staged = stager.stage({"model": {"w": torch.ones(10)}})
        assert torch.equal(staged["model"]["w"], torch.ones(10))
        slabs = [
            line for line in Path("/proc/self/maps").read_text().splitlines() if ".torch_checkpointing-staging-" in line
        ]
        assert slabs and all(os.fspath(tmp_path / "stg") in line for line in slabs), slabs
    finally:
        stager.close()
    assert not (tmp_path / "~").exists()
