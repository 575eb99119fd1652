"""A damaged or incomplete manifest's refusal names the fix for the operation that met it (round 36).

The manifest's parse errors, and an incomplete checkpoint's, said "Load an earlier checkpoint" to every reader:
an export, the CLI's `inspect`, `verify`, `diff` and `ls`, which load nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.test_cli import _cli
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.hf import export_hf


def _save(checkpoint: Path) -> Path:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(checkpoint), {"model": {"w": torch.ones(3)}})
    return checkpoint


def _edited(checkpoint: Path, edit: Callable[[dict[str, object]], None]) -> Path:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    edit(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    return checkpoint


def _unknown_version(checkpoint: Path) -> Path:
    """A changed byte in 'manifest_version' of this engine's manifest: damage, refused in `parse_manifest`."""
    return _edited(checkpoint, lambda m: m.update(manifest_version=999))


def _field_missing(checkpoint: Path) -> Path:
    """A required field gone: refused by a field check deep in the parse."""
    return _edited(checkpoint, lambda m: m.pop("world_size"))


def _incomplete(checkpoint: Path) -> Path:
    """The `.incomplete` marker of a save that never committed, no manifest beside it."""
    (checkpoint / "manifest.json").unlink()
    (checkpoint / ".incomplete").write_text("")
    return checkpoint


_DAMAGES = [_unknown_version, _field_missing, _incomplete]


def _refusal(said: str) -> None:
    """The fix is another checkpoint, worded for a user who loads nothing."""
    assert "earlier checkpoint" in said, said
    assert "load an earlier" not in said.lower(), said


@pytest.mark.parametrize("damage", _DAMAGES, ids=lambda d: d.__name__)
def test_export_of_a_bad_manifest_names_the_export(tmp_path: Path, damage: Callable[[Path], Path]) -> None:
    checkpoint = damage(_save(tmp_path / "step_1"))
    with pytest.raises(CheckpointError) as refused:
        export_hf(str(checkpoint), "model", str(tmp_path / "hf"))
    _refusal(str(refused.value))
    assert "Export from an earlier checkpoint" in str(refused.value), refused.value


@pytest.mark.parametrize("command", ["inspect", "verify", "diff"])
@pytest.mark.parametrize("damage", _DAMAGES, ids=lambda d: d.__name__)
def test_cli_command_on_a_bad_manifest_names_no_load(
    tmp_path: Path, command: str, damage: Callable[[Path], Path]
) -> None:
    intact = _save(tmp_path / "step_1")
    checkpoint = damage(_save(tmp_path / "step_2"))
    done = _cli(command, *([str(intact)] if command == "diff" else []), str(checkpoint))
    assert done.returncode != 0, done
    _refusal(done.stdout + done.stderr)


def test_ls_skipping_a_damaged_manifest_names_no_load(tmp_path: Path) -> None:
    _save(tmp_path / "step_1")
    _unknown_version(_save(tmp_path / "step_2"))
    done = _cli("ls", str(tmp_path))
    assert done.returncode == 0 and "step_1" in done.stdout, done
    said = done.stdout + done.stderr
    assert "step_2" in said and "manifest_version" in said, said
    _refusal(said)
