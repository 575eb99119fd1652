"""Saves never lose data: what a save may replace, errors after the commit, manifest facts, paths, payloads.

Each test here failed on the engine before the fix it names (issue 11).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.manifest import Manifest
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def _sync(**kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("storage_config", LocalFileSystemStorageConfig(use_direct_io=False))
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), **kwargs))


def _payload(tag: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.full((8,), tag)}}


# ------------------------------------------------------------------------------------------- manifest facts


def test_manifest_records_step_metrics_and_commit_time(tmp_path: Path) -> None:
    manager = _sync()
    try:
        before = time.time()
        manager.save(str(tmp_path / "step_0100"), _payload(), metrics={"loss": 1.5, "acc": 1})
        manager.save(str(tmp_path / "final"), _payload(), step=7)
        manager.save(str(tmp_path / "best"), _payload())
    finally:
        manager.close()
    first = json.loads((tmp_path / "step_0100" / "manifest.json").read_text())
    assert first["step"] == 100 and first["metrics"] == {"loss": 1.5, "acc": 1.0}
    assert before <= first["commit_time"] <= time.time()
    assert json.loads((tmp_path / "final" / "manifest.json").read_text())["step"] == 7
    best = Manifest.from_json((tmp_path / "best" / "manifest.json").read_text())
    assert best.step is None and best.metrics is None and best.commit_time is not None


def test_manifest_without_the_new_fields_still_reads(tmp_path: Path) -> None:
    old = {"kind": "torch_checkpointing.manifest", "manifest_version": 1, "library_version": "0.2.0",
           "world_size": 1, "metadata_file": None, "items": {}}
    manifest = Manifest.from_json(json.dumps(old))
    assert (manifest.step, manifest.metrics, manifest.commit_time) == (None, None, None)
    assert "step" not in json.loads(manifest.to_json())


@pytest.mark.parametrize("kwargs", [{"step": "7"}, {"step": True}, {"metrics": {"loss": "low"}}, {"metrics": [1.0]}])
def test_bad_step_or_metrics_are_refused(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    manager = _sync()
    try:
        with pytest.raises(TypeError):
            manager.save(str(tmp_path / "c"), _payload(), **kwargs)
    finally:
        manager.close()
    assert not (tmp_path / "c").exists()
