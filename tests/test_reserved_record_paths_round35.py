"""A manifest record naming a file the engine reserves is refused when the manifest is parsed (round 35).

A record of item 'model' whose path was `manifest.json` (a name no save gives an item's file) made a load say
"this load's layout reads 'model_0.pt'. Load with the layout it was saved with" (blaming the caller's layout),
and `inspect` listed it and exited 0. Now every reader refuses it alike, naming the record and the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.commit import RESERVED_FILE_NAMES
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.manifest import MANIFEST_FILE_NAME, parse_manifest

REPO = Path(__file__).resolve().parents[1]


def _saved(tmp_path: Path) -> Path:
    checkpoint = tmp_path / "step_1"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(checkpoint), {"model": {"w": torch.ones(3)}})
    return checkpoint


def _record_path(checkpoint: Path, path: str) -> None:
    manifest = json.loads((checkpoint / MANIFEST_FILE_NAME).read_text())
    manifest["items"]["model"]["0"]["path"] = path
    (checkpoint / MANIFEST_FILE_NAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize("reserved", [*sorted(RESERVED_FILE_NAMES), "./manifest.json", ".incomplete/x.pt"])
def test_a_record_naming_a_reserved_file_is_damage(tmp_path: Path, reserved: str) -> None:
    checkpoint = _saved(tmp_path)
    _record_path(checkpoint, reserved)
    text = (checkpoint / MANIFEST_FILE_NAME).read_text()
    with pytest.raises(CorruptCheckpointError, match=r"items\.model\.0") as refused:
        parse_manifest(text, str(checkpoint / MANIFEST_FILE_NAME))
    assert reserved in str(refused.value), refused.value
    with CheckpointManager(CheckpointManager.Config()) as manager, pytest.raises(CorruptCheckpointError) as loaded:
        manager.load(str(checkpoint), {"model": {"w": torch.zeros(3)}})
    assert "items.model.0" in str(loaded.value) and reserved in str(loaded.value), loaded.value


def test_inspect_refuses_it(tmp_path: Path) -> None:
    checkpoint = _saved(tmp_path)
    _record_path(checkpoint, MANIFEST_FILE_NAME)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", "inspect", str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode != 0, done.stdout
    assert "items.model.0" in done.stderr and MANIFEST_FILE_NAME in done.stderr, done.stderr
