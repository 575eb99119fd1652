"""A `~` staging directory means the home directory, as every other path argument's `~` does (round 32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager


def _slab_files() -> set[str]:
    """Where this process's staging slabs held in a directory live (their unlinked files' directories)."""
    found = set()
    for entry in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:  # the listing's own descriptor, closed since
            continue
        if "torch_checkpointing-staging" in target and target.endswith(".slab (deleted)"):
            found.add(os.path.dirname(target))
    return found


def test_a_home_staging_dir_stages_under_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: `staging_dir="~/stage"` was taken literally: the first staged save failed with OSError "Cannot
    create the async staging slab in ~/stage (No such file or directory)" though the directory exists."""
    home, work = tmp_path / "home", tmp_path / "work"
    (home / "stage").mkdir(parents=True)
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    config = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False, staging_dir="~/stage")
    stager = DefaultStager(config)
    try:
        staged = stager.stage({"m": {"x": torch.arange(4.0)}})
        assert torch.equal(staged["m"]["x"], torch.arange(4.0))
        assert str(home / "stage") in _slab_files()
    finally:
        stager.close()
    assert not (work / "~").exists()
