"""Saves and their commit (round 24): what the engine removes is only what it can prove it wrote.

* A user's file named `.incomplete` (a download tool's progress, a note) or `metadata.json` inside a committed
  checkpoint was taken for the engine's own by its name alone: overwriting the id (or retention deleting the
  checkpoint) deleted it with no word said. The engine writes neither there for a checkpoint whose manifest
  does not record it: a committed checkpoint holds no marker of ours, and its sharding metadata is named by its
  manifest (`metadata_file`). Such a file is now what any unlisted file is: the replace (and the delete) is
  refused, naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CommitError
from torch_checkpointing.retention import RetentionPolicy, apply_retention


def _manager() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((3,), value)}}


# Files a user may keep in a checkpoint directory whose names the engine also uses (for other checkpoints).
_USERS_FILES = {".incomplete": b"42% of weights.bin downloaded\n", "metadata.json": b'{"notes": "mine"}'}


@pytest.mark.parametrize("name", sorted(_USERS_FILES))
def test_overwrite_keeps_a_users_file_named_like_an_engine_file(tmp_path: Path, name: str) -> None:
    ck = tmp_path / "step_1"
    with _manager() as manager:
        manager.save(str(ck), _state(1.0))
        (ck / name).write_bytes(_USERS_FILES[name])
        with pytest.raises(CommitError, match=rf"not part of it \({name}\)"):
            manager.save(str(ck), _state(2.0))
    assert (ck / name).read_bytes() == _USERS_FILES[name]
    if name != ".incomplete":  # the user's marker makes it read as incomplete: the user's doing
        with _manager() as manager:
            assert torch.equal(manager.load(str(ck))["model"]["w"], torch.full((3,), 1.0))
    assert sorted(os.listdir(ck)) == sorted(["manifest.json", "model_0.pt", name])


@pytest.mark.parametrize("name", sorted(_USERS_FILES))
def test_retention_keeps_a_checkpoint_holding_a_users_file_named_like_an_engine_file(tmp_path: Path, name: str) -> None:
    with _manager() as manager:
        for step in (1, 2):
            manager.save(str(tmp_path / f"step_{step}"), _state(float(step)), step=step)
    (tmp_path / "step_1" / name).write_bytes(_USERS_FILES[name])
    if name == ".incomplete":  # a checkpoint with a foreign marker is no committed one: nothing lists it
        assert apply_retention(tmp_path, RetentionPolicy(keep_last=1)) == []
    else:
        apply_retention(tmp_path, RetentionPolicy(keep_last=1))
    assert (tmp_path / "step_1" / name).read_bytes() == _USERS_FILES[name]
