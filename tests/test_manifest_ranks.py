"""A manifest's file records belong to ranks of the save that wrote it: a record of rank >= world_size is a
manifest that its save never wrote (edited, or spliced from a larger save), refused as it is parsed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.manifest import parse_manifest


def _saved(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(str(root), {"model": torch.ones(2), "extra": torch.zeros(3)})
    return root


def _with_rank_5(manifest: dict) -> dict:  # type: ignore[type-arg]
    record = dict(manifest["items"]["extra"].pop("0"), rank=5)
    manifest["items"]["extra"]["5"] = record
    return manifest


def test_a_record_of_a_rank_the_save_did_not_have_is_refused_at_parse(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    text = json.dumps(_with_rank_5(json.loads((root / "manifest.json").read_text())))
    with pytest.raises(CorruptCheckpointError, match=r"items\.extra\.5.*rank 5.*1 rank\(s\).*world_size"):
        parse_manifest(text, str(root / "manifest.json"))


def test_a_load_of_such_a_checkpoint_names_the_manifest_and_changes_nothing(tmp_path: Path) -> None:
    root = _saved(tmp_path)
    path = root / "manifest.json"
    path.write_text(json.dumps(_with_rank_5(json.loads(path.read_text()))))
    template = torch.full((2,), 7.0)
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    with manager, pytest.raises(CorruptCheckpointError, match=r"manifest\.json.*rank 5"):
        manager.load(str(root), into={"model": template})
    assert torch.equal(template, torch.full((2,), 7.0))


@pytest.mark.parametrize("damaged", [2, 7, 10])
def test_a_world_size_raised_by_damage_names_the_field_not_a_resharder(tmp_path: Path, damaged: int) -> None:
    """One digit of 'world_size' damaged upwards (1 -> 7): the load said the item was saved by 7 ranks and told
    the user to declare a resharder, the wrong fix. No file of any rank but 0 is recorded: the field is what is
    wrong, and the load says so, changing nothing (round 24)."""
    root = _saved(tmp_path)
    path = root / "manifest.json"
    path.write_text(path.read_text().replace('"world_size": 1', f'"world_size": {damaged}'))
    template = torch.full((2,), 7.0)
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    with manager, pytest.raises(CorruptCheckpointError, match=rf"manifest\.json.*'world_size'.*{damaged}") as info:
        manager.load(str(root), into={"model": template})
    assert "resharder" not in str(info.value)
    assert torch.equal(template, torch.full((2,), 7.0))
