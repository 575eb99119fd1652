"""The read context's refusal of a checkpoint without a manifest names the operation that reads (round 35).

The shared read context names its operation ("load", "export", "check", "command") in its refusals; its refusal
of a directory without a manifest still said "this load asked for verification (verify_checksums=True or
allow_legacy_checkpoints=False)" to `damage()` and a listing's check, whose caller loaded nothing and set neither.
"""

from __future__ import annotations

from pathlib import Path

import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.discovery import damage
from torch_checkpointing.errors import IncompleteCheckpointError
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig


def _without_manifest(tmp_path: Path) -> Path:
    checkpoint = tmp_path / "step_1"
    with CheckpointManager(CheckpointManager.Config().with_sync_save()) as manager:
        manager.save(str(checkpoint), {"m": {"x": torch.ones(2)}})
    (checkpoint / "manifest.json").unlink()
    return checkpoint


def test_damage_of_a_checkpoint_without_a_manifest_names_no_load(tmp_path: Path) -> None:
    said = damage(_without_manifest(tmp_path))
    assert said is not None and "no manifest.json" in said, said
    assert "this load" not in said and "asked for verification" not in said, said
    assert "check" in said, said


def test_a_load_without_a_manifest_is_still_told_what_it_asked_for(tmp_path: Path) -> None:
    checkpoint = _without_manifest(tmp_path)
    policy = ReadPolicy(verify_checksums=True, allow_legacy_checkpoints=False)
    try:
        with CheckpointReadContext(LocalFileSystemStorage(LocalFileSystemStorageConfig()), str(checkpoint), policy):
            raise AssertionError("a checkpoint without a manifest was read under verification")
    except IncompleteCheckpointError as exc:
        assert "this load asked for verification" in str(exc), exc
