"""Warnings about a deliberate choice are said once per manager, and a replicated item can be declared so.

Issue 16, point 8: plain `step` tensors in a resharded optimizer state, a load onto one process without a
process group (its templates are plain tensors) and a {rank}-less layout on several ranks warned on every save
and every load. Each test below failed before: 3 saves + 2 loads gave 5 warnings, 3 saves on 2 ranks gave 3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.warning_jobs import said_about, shared_layout_warnings
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, ReplicatedLayoutInfo
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def _optimizer_state() -> dict[str, object]:
    """The FSDP2 shape on one process: per-parameter state with a plain scalar `step` tensor."""
    return {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4)}}, "param_groups": [{"lr": 0.1}]}


def test_plain_tensors_in_a_resharded_item_are_mentioned_once_per_manager(tmp_path: Path) -> None:
    manager = CheckpointManager(
        CheckpointManager.Config(
            items={"optimizer": ItemSpec(resharder=DTensorResharder())},
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )
    with said_about("plain (non-DTensor) tensors") as heard:
        for step in range(3):
            manager.save(str(tmp_path / f"step_{step}"), {"optimizer": _optimizer_state()})
        for _ in range(2):  # one process, no process group: the templates are plain tensors too
            manager.load(str(tmp_path / "step_2"), into={"optimizer": _optimizer_state()})
    manager.close()
    assert len(heard) == 1, heard


def test_a_second_manager_says_it_again(tmp_path: Path) -> None:
    """Once per manager, not once per process: a new manager (a new job phase) is told too."""
    for run in range(2):
        manager = CheckpointManager(
            CheckpointManager.Config(
                items={"optimizer": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
            )
        )
        with said_about("plain (non-DTensor) tensors") as heard:
            manager.save(str(tmp_path / f"run_{run}"), {"optimizer": _optimizer_state()})
            manager.save(str(tmp_path / f"run_{run}_b"), {"optimizer": _optimizer_state()})
        manager.close()
        assert len(heard) == 1, (run, heard)


def test_a_replicated_layout_must_not_hold_rank() -> None:
    with pytest.raises(ValueError, match=r"\{rank\}"):
        ReplicatedLayoutInfo("config_{rank}.json", JsonSerialization())
    layout = ReplicatedLayoutInfo("config.json", JsonSerialization())
    assert isinstance(layout, LayoutInfo) and layout.for_rank(3).file_path == "config.json"


@pytest.mark.multirank
def test_a_rank_less_layout_warns_once_and_not_at_all_when_declared_replicated(tmp_path: Path) -> None:
    from simulator.launcher import launch

    per_rank = launch(shared_layout_warnings, 2, args=(str(tmp_path), ReplicatedLayoutInfo), timeout=180)
    assert [r["plain"] for r in per_rank] == [1, 0], per_rank  # rank 0 says it, once for three saves
    assert [r["declared"] for r in per_rank] == [0, 0], per_rank
    for r in per_rank:  # every rank reads the one copy the lowest rank wrote
        assert r["plain_loaded"] == {"lr": 0.1, "step": 2} and r["declared_loaded"] == {"lr": 0.1, "step": 2}
