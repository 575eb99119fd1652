"""`ls` must name a checkpoint whose manifest is damaged, not drop it from its output.

Before: a checkpoint whose `manifest.json` is damaged (cut short, not JSON, a field out of range) was in no part
of `ls --json` ("checkpoints", "damaged", "unreadable") and on no line of the text listing: only a WARNING on
stderr said it existed. With the newest checkpoint so damaged, a script reading the document saw an older one as
the newest with nothing damaged, the class round 25 fixed for manifests this user may not read or a newer engine
wrote. Now each is listed under "damaged" with the reason (text: a `DAMAGED` line).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, cli, latest_checkpoint
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def _save(path: Path, value: float) -> None:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    with CheckpointManager(config) as manager:
        manager.save(str(path), {"model": {"w": torch.full((4,), value)}})


def _cut_short(manifest: Path) -> None:
    manifest.write_bytes(manifest.read_bytes()[:40])


def _world_size_zero(manifest: Path) -> None:
    doc = json.loads(manifest.read_text())
    doc["world_size"] = 0
    manifest.write_text(json.dumps(doc))


def _ls(mode: str, root: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main([mode, "ls", str(root)])
    return code, out.getvalue()


@pytest.mark.parametrize("damage", [_cut_short, _world_size_zero], ids=["cut-short", "field-out-of-range"])
def test_ls_lists_a_checkpoint_whose_manifest_is_damaged(tmp_path: Path, damage: Any) -> None:
    for step in (1, 2, 3):
        _save(tmp_path / f"step_{step}", float(step))
    for name in ("step_1", "step_3"):  # an older one and the newest
        damage(tmp_path / name / "manifest.json")
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step_2"

    code, out = _ls("--json", tmp_path)
    doc = json.loads(out)
    assert code == 0 and Path(doc["latest"]).name == "step_2", doc
    assert [c["name"] for c in doc["checkpoints"]] == ["step_2"], doc
    assert sorted(d["name"] for d in doc["damaged"]) == ["step_1", "step_3"], doc
    assert all("manifest.json" in d["problem"] for d in doc["damaged"]), doc
    assert doc["unreadable"] == [], doc

    code, text = _ls("--plain", tmp_path)
    assert code == 0
    for name in ("step_1", "step_3"):
        named = [line for line in text.splitlines() if name in line]
        assert named and all(line.startswith(f"DAMAGED {name}:") for line in named), text
