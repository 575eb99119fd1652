"""A checkpoint recording what only a newer engine knows is never reported as damage.

Round 25 told a newer engine's manifest (`manifest_version` 2) apart from damage. Everything else a newer engine
may record was still damage to this one: a file recorded in a serialization format it does not know
(`ZstdTorchSerialization`), sharding metadata of a higher version (`4.0`), a layout's format inside it. `verify`
said FAILED (exit 1: `verify || rm -rf` deletes it), `ls` listed it as damaged, a load raised plain
`CorruptCheckpointError` ("load an earlier checkpoint"). Now each is `NewerCheckpointError` (exit 2, listed as
unreadable), while a name no engine writes (`os.system`, a number) and damaged bytes stay damage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_cli_custom_sharding_round19 import _LoaderResharder
from tests.test_damage_not_newer_round26 import declare_newer_engine
from tests.test_verified_loads import _edit_manifest, _manager, _rewrite_metadata
from torch_checkpointing import CorruptCheckpointError, ItemSpec, NewerCheckpointError
from torch_checkpointing.cli import main

_NEWER_FORMAT = {"type": "ZstdTorchSerialization", "level": 3}


def _save(root: Path, items: dict[str, ItemSpec] | None = None, state: dict[str, Any] | None = None) -> Path:
    with _manager(items) as manager:
        manager.save(str(root), state or {"model": {"w": torch.ones(4)}})
    return root


def _set_format(root: Path, fmt: Any) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["items"]["model"]["0"]["format"] = fmt
        declare_newer_engine(d)  # even a newer engine writes no 'os.system'

    _edit_manifest(root, edit)


def _verify(capsys: pytest.CaptureFixture[str], root: Path) -> tuple[int, str]:
    code = main(["verify", str(root)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_verify_says_a_newer_engines_format_is_no_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect: exit 1 and "FAILED model_0.pt: ... no load reads" for a healthy checkpoint."""
    root = _save(tmp_path / "ck")
    _set_format(root, _NEWER_FORMAT)
    code, text = _verify(capsys, root)
    assert code == 2, text
    assert "FAILED" not in text and "ZstdTorchSerialization" in text and "do not delete" in text, text


def test_verify_still_fails_damaged_bytes_in_a_newer_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pins that the bytes are still checked: a newer format is no licence to pass a damaged file."""
    root = _save(tmp_path / "ck")
    _set_format(root, _NEWER_FORMAT)
    data = bytearray((root / "model_0.pt").read_bytes())
    data[-30] ^= 0xFF
    (root / "model_0.pt").write_bytes(bytes(data))
    code, text = _verify(capsys, root)
    assert code == 1 and "FAILED" in text and "model_0.pt" in text, text


@pytest.mark.parametrize(
    "fmt", [{"type": "os.system"}, {"type": 7}, {"type": ""}, {}], ids=["dotted", "int", "", "none"]
)
def test_a_format_name_no_engine_writes_is_still_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: dict[str, Any]
) -> None:
    root = _save(tmp_path / "ck")
    _set_format(root, fmt)
    code, text = _verify(capsys, root)
    assert code == 1 and "FAILED" in text, text
    with _manager() as manager, pytest.raises(CorruptCheckpointError) as info:
        manager.load(str(root))
    assert not isinstance(info.value, NewerCheckpointError), info.value


def test_a_load_of_a_newer_format_raises_newer_checkpoint_error(tmp_path: Path) -> None:
    """Defect: plain `CorruptCheckpointError` ("damaged or crafted"), which a caller deletes on."""
    root = _save(tmp_path / "ck")
    _set_format(root, _NEWER_FORMAT)
    template = torch.zeros(4)
    for into in (None, {"model": {"w": template}}):
        with _manager({"model": ItemSpec()}) as manager, pytest.raises(NewerCheckpointError, match="model_0.pt"):
            manager.load(str(root), into=into)
    assert torch.equal(template, torch.zeros(4))


def test_ls_lists_a_newer_format_as_unreadable_not_damaged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect: `ls --json` put it under "damaged" (a cleanup script deletes those)."""
    _save(tmp_path / "step_1")
    _set_format(_save(tmp_path / "step_2"), _NEWER_FORMAT)
    assert main(["ls", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in doc["unreadable"]] == ["step_2"], doc
    assert doc["damaged"] == [] and doc["latest"].endswith("step_1"), doc


def _resharded(root: Path) -> Path:
    items = {"loader": ItemSpec(resharder=_LoaderResharder())}
    return _save(root, items, {"loader": {"position": 3, "seen": torch.arange(4.0)}})


def _bump_metadata_version(d: dict[str, Any]) -> None:
    d["version"] = "4.0"


def _newer_layout_format(d: dict[str, Any]) -> None:
    layout = {"file_path": "loader_0.pt", "serialization_format": {"type": "ZstdTorchSerialization"}}
    d["metadata"]["loader"]["rank_to_layout_info"]["0"] = layout


@pytest.mark.parametrize("edit", [_bump_metadata_version, _newer_layout_format], ids=["version", "layout"])
def test_newer_sharding_metadata_is_no_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any) -> None:
    """Defect: a higher metadata version, or a layout in a format this engine does not know, was "metadata.json
    is malformed" to a load and FAILED (exit 1) to `verify`."""
    root = _resharded(tmp_path / "ck")
    _rewrite_metadata(root, edit)
    code, text = _verify(capsys, root)
    assert code == 2 and "FAILED" not in text, text
    items = {"loader": ItemSpec(resharder=_LoaderResharder())}
    with _manager(items) as manager, pytest.raises(NewerCheckpointError, match="metadata.json"):
        manager.load(str(root), into={"loader": {"position": 0, "seen": torch.zeros(4)}})


def test_a_damaged_metadata_version_is_still_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _resharded(tmp_path / "ck")
    _rewrite_metadata(root, lambda d: d.update(version="four"))
    code, text = _verify(capsys, root)
    assert code == 1 and "FAILED" in text, text


def test_ls_and_latest_pass_over_newer_sharding_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect: `latest_checkpoint` resumed from it (the load then refused it) and `ls` listed it as intact."""
    _resharded(tmp_path / "step_1")
    _rewrite_metadata(_resharded(tmp_path / "step_2"), _bump_metadata_version)
    assert main(["ls", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in doc["unreadable"]] == ["step_2"], doc
    assert doc["damaged"] == [] and doc["latest"].endswith("step_1"), doc


def _add_block_field(name: str) -> Any:
    def edit(d: dict[str, Any]) -> None:
        d["items"]["model"]["0"]["blocks"][name] = "xxh3"
        declare_newer_engine(d)

    return edit


def test_a_block_checksum_field_of_a_newer_engine_is_no_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect: a field beside 'blocks.crc32' (a newer engine's checksum algorithm) made the whole manifest
    "damaged": verify exit 1, and ls listed the checkpoint under "damaged"."""
    _save(tmp_path / "step_1")
    root = _save(tmp_path / "step_2")
    _edit_manifest(root, _add_block_field("algorithm"))
    code, text = _verify(capsys, root)
    assert code == 2 and "FAILED" not in text and "'algorithm'" in text, text
    assert main(["ls", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in doc["unreadable"]] == ["step_2"] and doc["damaged"] == [], doc
    _edit_manifest(root, lambda d: d["items"]["model"]["0"]["blocks"].pop("algorithm"))
    _edit_manifest(root, _add_block_field("not a name"))  # no engine writes such a field: damage
    code, text = _verify(capsys, root)
    assert code == 1, text
