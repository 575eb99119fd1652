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
