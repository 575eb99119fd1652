"""`iter_item_tensors` (what `torch-checkpointing diff` compares resharded items by) is no export (round 35).

The shared item reader was made to name an export in its refusals, and `iter_item_tensors` goes through it: a
file missing under it said "while this export ran (retry the export ...)", and a crafted file "Nothing was
exported; export from an intact checkpoint" to a caller that exported nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import export_hf, iter_item_tensors


def _saved_without_its_file(tmp_path: Path) -> Path:
    checkpoint = tmp_path / "step_1"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(checkpoint), {"model": {"w": torch.ones(2, 3)}})
    (checkpoint / "model_0.pt").unlink()
    return checkpoint


def test_a_missing_file_refused_to_iter_item_tensors_names_no_export(tmp_path: Path) -> None:
    checkpoint = _saved_without_its_file(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="missing") as refused:
        dict(iter_item_tensors(str(checkpoint), "model"))
    said = str(refused.value)
    assert "export" not in said and "load" not in said, said
    assert "retry the read" in said, said


def test_an_export_still_names_the_export(tmp_path: Path) -> None:
    checkpoint = _saved_without_its_file(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="missing") as refused:
        export_hf(str(checkpoint), "model", str(tmp_path / "hf"))
    assert "retry the export" in str(refused.value), refused.value
