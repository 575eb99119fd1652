"""A `protect=` id spelt as a URL with nothing after its scheme is refused, as an empty id is (round 33).

Round 33 refused an empty protected id ("names no checkpoint (an unset variable?)"): it protected nothing,
silently. `f"file://{STEP}"` with STEP unset is `file://`, read as the empty path: it was taken, protected
nothing, and the checkpoint it was meant to keep was deleted; `s3://` likewise names no checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig, list_checkpoints
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy, prune, select_for_deletion


def _run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2, 3):
            manager.save(str(root / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)
    return root


@pytest.mark.parametrize("protected", ["file://", "s3://"])
def test_a_url_naming_nothing_is_refused_before_anything_is_deleted(tmp_path: Path, protected: str) -> None:
    root = _run(tmp_path)
    policy = RetentionPolicy(keep_last=1)
    with pytest.raises(ConfigError, match="protect"):
        select_for_deletion(list_checkpoints(root), policy, protect=[protected])
    with pytest.raises(ConfigError, match="protect"):
        prune(root, policy, protect=[protected])
    assert [os.path.basename(c.path) for c in list_checkpoints(root)] == ["step_1", "step_2", "step_3"]


def test_a_file_url_naming_a_checkpoint_still_protects_it(tmp_path: Path) -> None:
    root = _run(tmp_path)
    prune(root, RetentionPolicy(keep_last=1), protect=[f"file://{root}/step_1"])
    assert [os.path.basename(c.path) for c in list_checkpoints(root)] == ["step_1", "step_3"]
