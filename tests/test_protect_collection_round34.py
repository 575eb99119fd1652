"""The retention calls refuse an argument of the wrong type by name, before anything is deleted.

Round 33 refused a lone str for `protect=` and each entry that names no checkpoint, but `protect=None` (a
caller's "nothing to protect", or an unset variable) and a lone int failed inside with a bare TypeError
("'NoneType' object is not iterable") that named neither the argument nor the fix; so did a policy that is no
RetentionPolicy (a bare AttributeError), and `select_for_deletion` given paths for its checkpoints ("'str'
object has no attribute 'path'"), or None, which it took as no checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig, list_checkpoints
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.retention import RetentionPolicy, apply_retention, prune, select_for_deletion


def _run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2):
            manager.save(str(root / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)
    return root


@pytest.mark.parametrize("protect", [None, 3, 2.5, object()], ids=["none", "int", "float", "object"])
def test_a_protect_that_is_no_collection_is_refused_by_name(tmp_path: Path, protect: Any) -> None:
    root = _run(tmp_path)
    policy = RetentionPolicy(keep_last=1)
    for call in (
        lambda: prune(root, policy, protect=protect),
        lambda: apply_retention(root, policy, protect=protect),
        lambda: select_for_deletion(list_checkpoints(root), policy, protect=protect),
    ):
        with pytest.raises(ConfigTypeError, match=r"protect= takes a collection of checkpoint ids"):
            call()
    assert [os.path.basename(c.path) for c in list_checkpoints(root)] == ["step_1", "step_2"]


def test_an_empty_collection_still_protects_nothing(tmp_path: Path) -> None:
    root = _run(tmp_path)
    prune(root, RetentionPolicy(keep_last=1), protect=[])
    assert [os.path.basename(c.path) for c in list_checkpoints(root)] == ["step_2"]


@pytest.mark.parametrize("policy", [None, {"keep_last": 1}], ids=["none", "dict"])
def test_a_policy_that_is_no_retention_policy_is_refused_by_name(tmp_path: Path, policy: Any) -> None:
    root = _run(tmp_path)
    for call in (
        lambda: prune(root, policy),
        lambda: apply_retention(root, policy),
        lambda: select_for_deletion(list_checkpoints(root), policy),
    ):
        with pytest.raises(ConfigTypeError, match=r"policy must be a RetentionPolicy"):
            call()
    assert [os.path.basename(c.path) for c in list_checkpoints(root)] == ["step_1", "step_2"]


def test_checkpoints_that_are_not_checkpoint_infos_are_refused_by_name(tmp_path: Path) -> None:
    root = _run(tmp_path)
    policy = RetentionPolicy(keep_last=1)
    paths = [c.path for c in list_checkpoints(root)]
    for checkpoints in (None, 3, paths, str(root)):
        with pytest.raises(ConfigTypeError, match=r"checkpoints must .*CheckpointInfo"):
            select_for_deletion(checkpoints, policy)  # type: ignore[arg-type]


def test_checkpoints_may_be_any_iterable_of_checkpoint_infos(tmp_path: Path) -> None:
    root = _run(tmp_path)
    doomed = select_for_deletion(iter(list_checkpoints(root)), RetentionPolicy(keep_last=1))
    assert [os.path.basename(c.path) for c in doomed] == ["step_1"]
