"""A manifest's `manifest_version` is read, not ignored (issue #10: load returns what was committed or raises a
`CheckpointError` naming the file and the reason).

Before, `parse_manifest` never looked at the field: a manifest of version 2 (a newer engine's, whose fields may
mean something else), or one whose version was damaged into `"1"`, `true`, `[1]` or removed, loaded as if it
were version 1, silently. The sharding metadata's own `version` was refused when unknown; the manifest's was
not. Now only the int 1 reads; anything else is a `CorruptCheckpointError` naming `manifest.json` and the field,
and for a higher int saying a newer engine wrote it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_checkpointing
from tests.test_damage_not_newer_round26 import declare_newer_engine
from tests.test_verified_loads import _edit_manifest, _manager
from torch_checkpointing import CheckpointManager, CorruptCheckpointError, ItemSpec
from torch_checkpointing.discovery import latest_checkpoint

_DROP = object()


def _save(root: Path, value: float = 1.0) -> None:
    with _manager({"model": ItemSpec()}) as manager:
        manager.save(str(root), {"model": {"w": torch.full((4,), value)}})


def _set_version(root: Path, version: Any) -> None:
    def edit(d: dict[str, Any]) -> None:
        if version is _DROP:
            del d["manifest_version"]
        else:
            d["manifest_version"] = version
            declare_newer_engine(d)  # a newer engine says so; a version above ours without it is damage

    _edit_manifest(root, edit)


def _load_into_fill(root: Path) -> tuple[CorruptCheckpointError, torch.Tensor]:
    template = torch.full((4,), -1.0)
    with _manager({"model": ItemSpec()}) as manager, pytest.raises(CorruptCheckpointError) as caught:
        manager.load(str(root), into={"model": {"w": template}})
    return caught.value, template


_DAMAGED_FOR_TYPE = {"0": 0, "-1": -1, "str": "2"}


@pytest.mark.parametrize("version", [2, 1 << 40], ids=["2", "2**40"])
def test_a_manifest_of_a_newer_version_is_refused_saying_so(tmp_path: Path, version: int) -> None:
    """Defect: a version-2 manifest loaded as version 1 (no error at all)."""
    root = tmp_path / "ck"
    _save(root)
    _set_version(root, version)
    error, template = _load_into_fill(root)
    message = str(error)
    assert "manifest.json" in message and "'manifest_version'" in message, message
    assert "newer" in message, message
    assert bool((template == -1.0).all())
    # A caller tells it from damage by its public type (a CorruptCheckpointError for those that catch one).
    assert isinstance(error, torch_checkpointing.NewerCheckpointError), type(error)


@pytest.mark.parametrize("version", list(_DAMAGED_FOR_TYPE.values()), ids=list(_DAMAGED_FOR_TYPE))
def test_a_damaged_version_is_not_a_newer_checkpoint(tmp_path: Path, version: Any) -> None:
    root = tmp_path / "ck"
    _save(root)
    _set_version(root, version)
    error, _ = _load_into_fill(root)
    assert not isinstance(error, torch_checkpointing.NewerCheckpointError), error


_DAMAGED = {"str": "1", "bool": True, "float": 1.0, "list": [1], "null": None, "0": 0, "-1": -1, "gone": _DROP}


@pytest.mark.parametrize("version", list(_DAMAGED.values()), ids=list(_DAMAGED))
def test_a_damaged_manifest_version_is_refused_naming_the_field(tmp_path: Path, version: Any) -> None:
    """Defect: a version damaged to another type, a non-positive int, or removed, loaded silently."""
    root = tmp_path / "ck"
    _save(root)
    _set_version(root, version)
    error, template = _load_into_fill(root)
    assert "manifest.json" in str(error) and "'manifest_version'" in str(error), str(error)
    assert bool((template == -1.0).all())


def test_a_load_without_templates_refuses_a_newer_manifest_too(tmp_path: Path) -> None:
    """Defect: the self-describing load (layouts read from the manifest) trusted a version-2 manifest too."""
    root = tmp_path / "ck"
    _save(root)
    _set_version(root, 2)
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    with manager, pytest.raises(CorruptCheckpointError, match="manifest_version"):
        manager.load(str(root))


def test_latest_skips_a_newer_checkpoint_saying_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Defect: `latest_checkpoint` resumed from a checkpoint this engine cannot read (version 2). Now it resumes
    from the newest one it reads, and the WARNING says a newer engine wrote the other."""
    _save(tmp_path / "step_1", 1.0)
    _save(tmp_path / "step_2", 2.0)
    _set_version(tmp_path / "step_2", 2)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        latest = latest_checkpoint(str(tmp_path))
    assert latest is not None and Path(latest.path).name == "step_1", latest
    assert any("step_2" in r.getMessage() and "newer" in r.getMessage() for r in caplog.records), caplog.text


def test_the_version_this_engine_writes_still_loads(tmp_path: Path) -> None:
    """Pins that the fix reads what the engine writes (version 1), with and without templates."""
    root = tmp_path / "ck"
    _save(root, 3.0)
    template = torch.zeros(4)
    with _manager({"model": ItemSpec()}) as manager:
        manager.load(str(root), into={"model": {"w": template}})
    assert template.tolist() == [3.0] * 4


def test_verify_of_a_newer_checkpoint_exits_2_not_failed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect: `verify` said FAILED and exited 1 ("the bytes do not match") for a checkpoint a newer engine
    wrote, and listings skipped it as "a damaged checkpoint": an operator could delete a healthy checkpoint.
    Now exit 2 (it could not check), as for a file it may not read (round 24), and no "damaged"."""
    from torch_checkpointing import cli

    root = tmp_path / "step_2"
    _save(root)
    _set_version(root, 2)
    code = cli.main(["--plain", "verify", str(root)])
    out = capsys.readouterr()
    assert code == 2, (code, out)
    assert "newer" in out.out + out.err and "FAILED" not in out.out, out


def test_listings_do_not_call_a_newer_checkpoint_damaged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Defect: the WARNING said "Skipping ..., a damaged checkpoint" for a version-2 manifest."""
    _save(tmp_path / "step_2")
    _set_version(tmp_path / "step_2", 2)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert latest_checkpoint(str(tmp_path)) is None
    skipped = [r.getMessage() for r in caplog.records if "step_2" in r.getMessage()]
    assert skipped and all("a damaged checkpoint" not in m and "newer" in m for m in skipped), skipped


def test_ls_names_a_newer_checkpoint_apart_from_damaged_ones(tmp_path: Path) -> None:
    """Defect: `ls` left a checkpoint a newer engine wrote out of every part of its output (`--json`: not in
    "checkpoints", "damaged" nor "unreadable"; text: no line), saying so only in a WARNING on stderr. A script
    reading the document, or an operator reading the table, saw `step_1` as the newest checkpoint with nothing
    newer, as for a manifest this user may not read before round 25. Now it is listed under "unreadable" (not
    loadable here, never "damaged": it is not to be deleted) with the reason."""
    import contextlib
    import io
    import json

    from torch_checkpointing import cli

    _save(tmp_path / "step_1", 1.0)
    _save(tmp_path / "step_2", 2.0)
    _set_version(tmp_path / "step_2", 2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["--json", "ls", str(tmp_path)]) == 0
    doc = json.loads(out.getvalue())
    assert Path(doc["latest"]).name == "step_1" and doc["damaged"] == [], doc
    assert [u["name"] for u in doc["unreadable"]] == ["step_2"], doc
    assert "newer engine" in doc["unreadable"][0]["problem"], doc
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["--plain", "ls", str(tmp_path)]) == 0
    named = [line for line in text.getvalue().splitlines() if "step_2" in line]
    assert named and all("DAMAGED" not in line and "newer engine" in line for line in named), text.getvalue()


def test_a_save_inside_a_newer_checkpoint_is_refused(tmp_path: Path) -> None:
    """Defect: a save refuses an id inside a checkpoint of ours (its files would be ones that checkpoint does not
    list, and deleting that checkpoint would take them along), but took one whose manifest a newer engine wrote
    for a plain folder and saved inside it, once the version was read."""
    from torch_checkpointing.errors import CommitError

    _save(tmp_path / "step_2", 2.0)
    _set_version(tmp_path / "step_2", 2)
    with _manager({"model": ItemSpec()}) as manager, pytest.raises(CommitError, match="inside the checkpoint"):
        manager.save(str(tmp_path / "step_2" / "inner"), {"model": {"w": torch.zeros(4)}})
    assert not (tmp_path / "step_2" / "inner").exists()


def test_a_save_over_a_newer_checkpoint_is_refused_saying_a_newer_engine_wrote_it(tmp_path: Path) -> None:
    """Defect: a save to the id of a newer engine's checkpoint was refused calling its manifest "not a
    torch_checkpointing manifest" (and then, quoted, "a newer engine wrote this checkpoint")."""
    from torch_checkpointing.errors import CommitError

    _save(tmp_path / "step_2", 2.0)
    _set_version(tmp_path / "step_2", 2)
    with _manager({"model": ItemSpec()}) as manager, pytest.raises(CommitError) as caught:
        manager.save(str(tmp_path / "step_2"), {"model": {"w": torch.zeros(4)}})
    message = str(caught.value)
    assert "newer engine" in message and "not a torch_checkpointing manifest" not in message, message
    assert json_version(tmp_path / "step_2") == 2  # untouched


def json_version(root: Path) -> Any:
    import json

    return json.loads((root / "manifest.json").read_text())["manifest_version"]
