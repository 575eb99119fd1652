"""`prune` names the checkpoints it could not weigh, in its JSON document as in its text.

A checkpoint whose manifest is damaged (or a newer engine's, or one this user may not read) is in no listing,
so a retention pass never weighs it. `prune --json` only logged a WARNING about it: a script reading the
document saw nothing left behind, and a disk filled with checkpoints nobody was told about. Now the report
(`PruneReport.not_listed`) and the document list them, as `ls --json` does: damage under "damaged", a newer
engine's under "unreadable" (never to be deleted as damage).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_damage_not_newer_round26 import declare_newer_engine
from tests.test_verified_loads import _edit_manifest, _manager
from torch_checkpointing.cli import main
from torch_checkpointing.retention import RetentionPolicy, prune


def _root(tmp_path: Path) -> Path:
    with _manager() as manager:
        for step in range(1, 5):
            manager.save(str(tmp_path / f"step_{step}"), {"model": {"w": torch.full((2,), float(step))}})
    (tmp_path / "step_1" / "manifest.json").write_text("{ truncated")

    def newer(d: dict[str, Any]) -> None:
        d["manifest_version"] = 2
        declare_newer_engine(d)

    _edit_manifest(tmp_path / "step_2", newer)
    return tmp_path


@pytest.mark.parametrize("dry_run", [False, True], ids=["prune", "dry-run"])
def test_prune_json_names_the_checkpoints_it_could_not_weigh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dry_run: bool
) -> None:
    """Defect: the document had no such entry (KeyError 'damaged'); only a WARNING on stderr named them."""
    root = _root(tmp_path)
    argv = ["prune", str(root), "--keep-last", "1", "--json"] + (["--dry-run"] if dry_run else [])
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in doc["damaged"]] == ["step_1"], doc
    assert [p["name"] for p in doc["unreadable"]] == ["step_2"], doc
    assert "manifest_version" in doc["unreadable"][0]["problem"], doc
    assert [c["name"] for c in doc["deleted"]] == ["step_3"], doc
    assert (root / "step_1").is_dir() and (root / "step_2").is_dir()


def test_prune_text_names_them_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path)
    assert main(["prune", str(root), "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "DAMAGED step_1" in out and "UNREADABLE step_2" in out, out


def test_the_python_report_carries_them(tmp_path: Path) -> None:
    report = prune(_root(tmp_path), RetentionPolicy(keep_last=1), dry_run=True)
    assert sorted((p.name, p.unreadable) for p in report.not_listed) == [("step_1", False), ("step_2", True)]


@pytest.mark.parametrize("dry_run", [False, True], ids=["gc", "dry-run"])
def test_gc_json_names_a_newer_engines_checkpoint_it_leaves_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dry_run: bool
) -> None:
    """Defect: gc left it out of its report (an INFO line only), so `gc --json` said nothing of a directory
    holding an `.incomplete` marker it would not collect. It is now under "kept", with why."""
    with _manager() as manager:
        manager.save(str(tmp_path / "x"), {"model": {"w": torch.ones(2)}})

    def newer(d: dict[str, Any]) -> None:
        d["manifest_version"] = 2
        declare_newer_engine(d)

    _edit_manifest(tmp_path / "x", newer)
    (tmp_path / "x" / ".incomplete").touch()  # a claim of a save that never finished, beside its commit
    argv = ["gc", str(tmp_path), "--older-than", "0", "--json"] + (["--dry-run"] if dry_run else [])
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [Path(k["path"]).name for k in doc["kept"]] == ["x"], doc
    assert "newer engine" in doc["kept"][0]["reason"] and doc["removed"] == [], doc
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == [".incomplete", "manifest.json", "model_0.pt"]
