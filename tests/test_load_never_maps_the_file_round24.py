"""A load's result never maps the checkpoint's file (round 24, issue #10).

Torch and safetensors files were decoded from a mapping of the file itself: the tensors a load without a
template returned were views of the file, so a file written into in place afterwards changed the caller's data
(bytes nobody verified), and one truncated afterwards killed the process with SIGBUS at the next touch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization

FORMATS = {"torch": None, "safetensors": LayoutInfo("m.safetensors", SafetensorsSerialization())}


def _save(path: Path, fmt: str) -> Path:
    manager = CheckpointManager(_config(fmt))
    manager.save(str(path), {"m": {"w": torch.arange(1 << 16, dtype=torch.float32)}})
    manager.close()
    return path / ("m.safetensors" if fmt == "safetensors" else "m_0.pt")


def _config(fmt: str) -> CheckpointManager.Config:
    config = CheckpointManager.Config.with_sync_save()
    config.items = {"m": ItemSpec(layout=FORMATS[fmt])}
    return config


def _overwrite_payload(file: Path) -> None:
    """Write into the file in place (same inode) where the tensor's values 1.0, 2.0, 3.0 lie."""
    data = file.read_bytes()
    at = data.find(torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes())
    assert at > 0
    with open(file, "r+b") as handle:
        handle.seek(at)
        handle.write(b"\xff" * 12)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_file_written_in_place_after_load_leaves_the_result_alone(tmp_path: Path, fmt: str) -> None:
    file = _save(tmp_path / "ckpt", fmt)
    manager = CheckpointManager(_config(fmt))
    loaded = manager.load(str(tmp_path / "ckpt"), {"m": None})["m"]["w"]
    _overwrite_payload(file)
    assert torch.equal(loaded, torch.arange(1 << 16, dtype=torch.float32))
    manager.close()


_TRUNCATE_AFTER_LOAD = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_load_never_maps_the_file_round24 import _config
from torch_checkpointing import CheckpointManager
fmt, ckpt, file = sys.argv[1:4]
manager = CheckpointManager(_config(fmt))
loaded = manager.load(ckpt, {{"m": None}})["m"]["w"]
os.truncate(file, 64)
print(float(loaded.sum()))
"""


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_file_truncated_after_load_does_not_kill_the_process(tmp_path: Path, fmt: str) -> None:
    file = _save(tmp_path / "ckpt", fmt)
    script = textwrap.dedent(_TRUNCATE_AFTER_LOAD.format(tests=str(Path(__file__).parent)))
    paths = [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, "-c", script, fmt, str(tmp_path / "ckpt"), str(file)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode != -signal.SIGBUS, "the load's result was a mapping of the file: SIGBUS"
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == float(torch.arange(1 << 16, dtype=torch.float32).sum())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_load_into_templates_copies_no_file_into_memory(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a load that returns what it decoded needs a private copy: one into templates copies out of the
    mapping into the caller's tensors. A copy of every file held the file's size in memory for the whole load
    and made a warm 256 MiB load several times slower (python -m benchmarks, load_vs_raw_read)."""
    import torch_checkpointing.read_context as read_context

    copies: list[int] = []
    real = read_context.private_copy
    monkeypatch.setattr(
        read_context, "private_copy", lambda fd, size, on_short: copies.append(size) or real(fd, size, on_short)
    )
    _save(tmp_path / "ckpt", fmt)
    manager = CheckpointManager(_config(fmt))
    template = {"m": {"w": torch.zeros(1 << 16)}}
    manager.load(str(tmp_path / "ckpt"), template)
    assert torch.equal(template["m"]["w"], torch.arange(1 << 16, dtype=torch.float32))
    assert copies == []
    manager.load(str(tmp_path / "ckpt"), {"m": None})
    assert len(copies) == 1
    manager.close()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_entries_a_template_returns_as_saved_are_not_views_of_the_file(tmp_path: Path, fmt: str) -> None:
    """A load into a template copies into its tensors out of a mapping of the file; what it returns as decoded
    (entries the template lacks, a None in it) were views of that mapping: a write into the file changed them."""
    manager = CheckpointManager(_config(fmt))
    saved = {"w": torch.arange(1 << 16, dtype=torch.float32), "x": torch.full((4,), 7.0)}
    manager.save(str(tmp_path / "ckpt"), {"m": {**saved, "y": torch.full((4,), 9.0)}})
    file = tmp_path / "ckpt" / ("m.safetensors" if fmt == "safetensors" else "m_0.pt")
    loaded = manager.load(str(tmp_path / "ckpt"), {"m": {"x": torch.zeros(4), "y": None}})["m"]
    _overwrite_payload(file)
    assert torch.equal(loaded["w"], saved["w"]), "an entry the template lacks changed with the file"
    assert torch.equal(loaded["y"], torch.full((4,), 9.0))
    manager.close()
