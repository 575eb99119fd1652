"""`select_for_deletion(..., protect=)` keeps a protected checkpoint however its id is spelt, as `prune` does.

Before, it compared the raw strings: a protected id spelt `~/run/step_1`, relative to the working directory, or
with a trailing `/` or `./` matched no listed path, and the checkpoint it meant was selected for deletion.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy, select_for_deletion


@pytest.fixture
def home_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Steps 1 to 3 under HOME/run; the working directory is HOME."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2, 3):
            manager.save(str(home / "run" / f"step_{step}"), {"m": {"x": torch.ones(2)}})
    return home


@pytest.mark.parametrize("spelling", ["~/run/step_1", "run/step_1", "./run/step_1", "{home}/run//step_1/"])
def test_a_protected_id_keeps_its_checkpoint_however_spelt(home_run: Path, spelling: str) -> None:
    found = list_checkpoints(home_run / "run")
    doomed = select_for_deletion(found, RetentionPolicy(keep_last=1), protect=[spelling.format(home=home_run)])
    assert [c.step for c in doomed] == [2]


def test_a_protected_id_of_nothing_listed_protects_nothing(home_run: Path) -> None:
    found = list_checkpoints(home_run / "run")
    doomed = select_for_deletion(found, RetentionPolicy(keep_last=1), protect=["~/other/step_1"])
    assert [c.step for c in doomed] == [1, 2]
