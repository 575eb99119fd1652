"""A retention root given as a `file://` URL is read as the manager reads its ids (round 32).

A manager writing local paths takes `file:///abs/run/step_1` as the path `/abs/run/step_1`; a policy whose root
was spelt the same way was refused inside every retention pass (a warning per save), and nothing was pruned.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.checkpoint_manager import SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy, prune, select_for_deletion
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


@pytest.mark.parametrize("storage_config", [None, LocalFileSystemStorageConfig()], ids=["no-config", "local"])
def test_a_file_url_root_prunes_the_saves_under_it(tmp_path: Path, storage_config: object) -> None:
    policy = RetentionPolicy(keep_last=1, root=f"file://{tmp_path}/run")
    extra = {} if storage_config is None else {"storage_config": storage_config}
    manager = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), retention=policy, **extra))
    try:
        for step in range(3):
            manager.save(f"file://{tmp_path}/run/step_{step}", {"model": {"w": torch.ones(2)}})
    finally:
        manager.close()  # finishes the retention passes scheduled
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_2"]


def test_a_checkpoint_protected_by_its_file_url_is_kept(tmp_path: Path) -> None:
    """The id a manager saved under, `file:///abs/run/step_0`, protects that checkpoint from `prune` (it matched
    no listed path, and the checkpoint it named was deleted)."""
    manager = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))
    try:
        for step in range(3):
            manager.save(f"file://{tmp_path}/run/step_{step}", {"model": {"w": torch.ones(2)}})
    finally:
        manager.close()
    protected = f"file://{tmp_path}/run/step_0"
    listed = list_checkpoints(tmp_path / "run")
    assert [
        Path(c.path).name for c in select_for_deletion(listed, RetentionPolicy(keep_last=1), protect=[protected])
    ] == ["step_1"]
    report = prune(tmp_path / "run", RetentionPolicy(keep_last=1), protect=[protected])
    assert [Path(c.path).name for c in report.deleted] == ["step_1"] and not report.failed
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_0", "step_2"]
