"""A changed byte in our own manifest is damage, never "a newer engine's checkpoint, do not delete it".

The manifest carries no checksum of its own, and round 26 calls every well-formed name this engine does not know
a newer engine's (`NewerCheckpointError`: `verify` exit 2, `ls` "unreadable", never deleted). One flipped bit
turns `TorchSerialization` into `TorchSerializatiom`, or `manifest_version` 1 into 3, both well-formed: a damaged
checkpoint was reported healthy and kept. A newer engine declares itself in `library_version`; an unknown name in
a manifest whose `library_version` is not above this engine's is damage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_cli_custom_sharding_round19 import _LoaderResharder
from tests.test_verified_loads import _edit_manifest, _manager
from torch_checkpointing import CorruptCheckpointError, ItemSpec, NewerCheckpointError, __version__
from torch_checkpointing.cli import main

_FLIPS = [
    (b'"TorchSerialization"', b'"TorchSerializatiom"'),  # 'n' (0x6e) -> 'm' (0x6d): one bit
    (b'"manifest_version": 1', b'"manifest_version": 3'),  # '1' (0x31) -> '3' (0x33): one bit
]


def _save(root: Path) -> Path:
    with _manager() as manager:
        manager.save(str(root), {"model": {"w": torch.ones(4)}})
    return root


def _flip(root: Path, old: bytes, new: bytes, name: str = "manifest.json") -> None:
    data = (root / name).read_bytes()
    assert data.count(old) == 1 and len(old) == len(new), data
    (root / name).write_bytes(data.replace(old, new))


@pytest.mark.parametrize(("old", "new"), _FLIPS, ids=["format", "manifest_version"])
def test_a_flipped_byte_in_our_manifest_is_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: bytes, new: bytes
) -> None:
    """Defect: verify exit 2 ('not damaged ... do not delete it'), ls "unreadable", load NewerCheckpointError."""
    _save(tmp_path / "step_1")
    root = _save(tmp_path / "step_2")
    _flip(root, old, new)
    code = main(["verify", str(root)])
    text = capsys.readouterr()
    assert code == 1 and "FAILED" in text.out + text.err and "do not delete" not in text.out + text.err, text
    assert main(["ls", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in doc["damaged"]] == ["step_2"] and doc["unreadable"] == [], doc
    with _manager() as manager, pytest.raises(CorruptCheckpointError, match="library_version") as info:
        manager.load(str(root))
    assert not isinstance(info.value, NewerCheckpointError), info.value


def declare_newer_engine(d: dict[str, Any]) -> None:
    """Edit a manifest as a newer engine writes it: its `library_version` above this engine's."""
    major = int(__version__.split(".")[0]) if __version__[:1].isdigit() else 0
    d["library_version"] = f"{major + 1}.0.0"


@pytest.mark.parametrize(("old", "new"), _FLIPS, ids=["format", "manifest_version"])
def test_the_same_names_from_a_declared_newer_engine_are_no_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: bytes, new: bytes
) -> None:
    """Pins the other side: a manifest whose library_version is above this engine's may hold what it lacks."""
    root = _save(tmp_path / "ck")
    _edit_manifest(root, declare_newer_engine)
    _flip(root, old, new)
    assert main(["verify", str(root)]) == 2, capsys.readouterr()
    with _manager() as manager, pytest.raises(NewerCheckpointError):
        manager.load(str(root))


def test_ls_checks_the_bytes_of_sharding_metadata_it_calls_a_newer_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect: `ls` parses metadata.json unchecked (no CRC: it reads no item's bytes) to find a newer engine's
    version, so '"version": "3.0"' with one bit changed to "7.0" was listed "unreadable ... do not delete it",
    though the manifest's metadata_crc32 says those bytes are not what was saved (verify says FAILED)."""
    items = {"loader": ItemSpec(resharder=_LoaderResharder())}
    with _manager(items) as manager:
        for step in (1, 2):
            manager.save(str(tmp_path / f"step_{step}"), {"loader": {"position": 3, "seen": torch.arange(4.0)}})
    _flip(tmp_path / "step_2", b'"version": "3.0"', b'"version": "7.0"', "metadata.json")  # '3' -> '7': one bit
    assert main(["ls", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in doc["damaged"]] == ["step_2"] and doc["unreadable"] == [], doc
    assert "CRC32" in doc["damaged"][0]["problem"], doc
