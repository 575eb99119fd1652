"""An export's refusal names the export, not a load (round 35).

The export reads an item's files through the same block readers and the same verifying read context as a
resharding load. Their messages named the operation they were written for: a crafted safetensors header (a
name that is a lone surrogate, with the manifest's checksums made to match) failed the export with "File ...
for a resharding load cannot be decoded", a Torch file the safe loader refuses with "Refused to load a
resharding source ... Keep resharded items to tensors", though nothing was being loaded or resharded.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import export_hf

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 120  # the CLI takes seconds (importing torch); this only stops a hang
SAFETENSORS = {"model": ItemSpec(layout=LayoutInfo("model.safetensors", SafetensorsSerialization()))}


def _save(checkpoint: Path, items: dict[str, ItemSpec]) -> None:
    config = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig())
    with CheckpointManager(config) as manager:
        manager.save(str(checkpoint), {"model": {"w": torch.ones(2, 3)}})


def _rewrite(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace the file `name` by `data` and record its size and checksums in the manifest, as a crafter would."""
    (checkpoint / name).write_bytes(data)
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for ranks in manifest["items"].values():
        for entry in ranks.values():
            if entry["path"] == name:
                size = entry["blocks"]["block_size"]
                entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
                blocks = (data[at : at + size] for at in range(0, len(data), size))
                entry["blocks"]["crc32"] = "".join(f"{zlib.crc32(block):08x}" for block in blocks)
    manifest_path.write_text(json.dumps(manifest))


def _surrogate_named(tmp_path: Path) -> Path:
    checkpoint = tmp_path / "step_1"
    _save(checkpoint, SAFETENSORS)
    data = (checkpoint / "model.safetensors").read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = data[8 : 8 + size].replace(b'"w"', b'"\\ud800"')
    _rewrite(checkpoint, "model.safetensors", struct.pack("<Q", len(header)) + header + data[8 + size :])
    return checkpoint


def _unpicklable(tmp_path: Path) -> Path:
    checkpoint = tmp_path / "step_1"
    _save(checkpoint, {})
    _rewrite(checkpoint, "model_0.pt", b"garbage" * 50)  # no zip: torch's legacy unpickler refuses its opcodes
    return checkpoint


def _export_cli(checkpoint: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_checkpointing",
            "export",
            "--item",
            "model",
            "--to",
            "hf",
            str(checkpoint),
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )


def _says_export(message: str) -> None:
    assert "resharding" not in message and "resharded" not in message, message
    assert "export" in message, message


@pytest.mark.parametrize("crafted", [_surrogate_named, _unpicklable])
def test_a_crafted_file_refused_by_an_export_names_the_export(tmp_path: Path, crafted: object) -> None:
    checkpoint = crafted(tmp_path)  # type: ignore[operator]
    with pytest.raises(CorruptCheckpointError, match="model") as refused:
        export_hf(str(checkpoint), "model", str(tmp_path / "hf"))
    _says_export(str(refused.value))
    assert not (tmp_path / "hf").exists()


def test_the_cli_export_refuses_it_with_the_same_words(tmp_path: Path) -> None:
    checkpoint = _surrogate_named(tmp_path)
    done = _export_cli(checkpoint, tmp_path / "hf")
    assert done.returncode != 0, done
    _says_export(done.stderr)
    assert str(checkpoint / "model.safetensors") in done.stderr, done.stderr


def test_a_missing_file_refused_by_an_export_names_the_export(tmp_path: Path) -> None:
    """The verifying read context's words ("while this load ran (retry the load ...)") were a load's in every
    reader: an export, and the CLI's verify and diff."""
    checkpoint = tmp_path / "step_1"
    _save(checkpoint, {})
    (checkpoint / "model_0.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match="missing") as refused:
        export_hf(str(checkpoint), "model", str(tmp_path / "hf"))
    assert "load" not in str(refused.value) and "retry the export" in str(refused.value), refused.value


def test_a_missing_file_refused_by_cli_verify_names_no_load(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step_1"
    _save(checkpoint, {})
    (checkpoint / "model_0.pt").unlink()
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", "verify", str(checkpoint)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert done.returncode == 1, done
    assert "missing" in done.stdout and "load" not in done.stdout, done.stdout
