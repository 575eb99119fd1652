"""A `protect=` id of `prune` or `select_for_deletion` that can name no checkpoint is refused, naming it.

An entry of the wrong type failed inside with a bare TypeError ("cannot use a string pattern on a bytes-like
object" for bytes, "expected str, bytes or os.PathLike object, not int"); an empty one, or one holding a lone
surrogate, protected nothing, silently; and a lone str given for the collection was taken as its characters,
each an id naming nothing, so the checkpoint it named was deleted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig, list_checkpoints
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.retention import RetentionPolicy, prune, select_for_deletion


def _run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2, 3):
            manager.save(str(root / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)
    return root


@pytest.mark.parametrize(
    ("protect", "error"),
    [
        pytest.param([""], ConfigError, id="empty"),
        pytest.param(["run/\ud800"], ConfigError, id="surrogate"),
        pytest.param([b"run/step_1"], ConfigTypeError, id="bytes"),
        pytest.param([1], ConfigTypeError, id="int"),
        pytest.param("STEP_1", ConfigTypeError, id="a-lone-str"),
    ],
)
def test_a_protected_id_that_names_no_checkpoint_is_refused(tmp_path: Path, protect: Any, error: type) -> None:
    root = _run(tmp_path)
    if protect == "STEP_1":
        protect = str(root / "step_1")
    policy = RetentionPolicy(keep_last=1)
    with pytest.raises(error, match="protect"):
        prune(root, policy, protect=protect)
    with pytest.raises(error, match="protect"):
        select_for_deletion(list_checkpoints(root), policy, protect=protect)
    assert [os.path.basename(c.path) for c in list_checkpoints(root)] == ["step_1", "step_2", "step_3"]


def test_ids_of_every_path_type_still_protect(tmp_path: Path) -> None:
    root = _run(tmp_path)
    prune(root, RetentionPolicy(keep_last=1), protect=(p for p in [root / "step_1", str(root / "step_2")]))
    assert [os.path.basename(c.path) for c in list_checkpoints(root)] == ["step_1", "step_2", "step_3"]
