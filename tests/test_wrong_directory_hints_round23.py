"""A load or a command given a directory that is not a checkpoint, where the directory itself tells what was meant.

The two mistakes users make: passing the run's root (`load("runs/exp1")`, `torch-checkpointing inspect
runs/exp1`) for one of its checkpoints, and passing the hidden temporary directory a killed save left (found
with `ls -a`) for the checkpoint of its id. Before, both said only "<path>: no manifest.json: not a checkpoint":
the path, not the fix. Now the error names the checkpoint to pass (the root's newest, the temporary's id) and
how to find or clean up the rest; a directory that tells nothing keeps the plain message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import IncompleteCheckpointError
from torch_checkpointing.manifest import HINT_ENTRIES, INCOMPLETE_MARKER

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch


def _manager() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with _manager() as manager:
        for step in (10, 2):  # the newest by step is not the last saved nor the last by name
            manager.save(str(root / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}})
    return root


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    """A child Python run from the repository with `args`, its output captured, bounded by the timeout."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )


def _load_error(path: Path) -> str:
    with _manager() as manager, pytest.raises(IncompleteCheckpointError) as info:
        manager.load(str(path))
    return str(info.value)


def test_loading_a_runs_root_names_its_newest_checkpoint_and_how_to_list_them(run: Path) -> None:
    text = _load_error(run)
    assert f"{run}: no manifest.json: not a checkpoint" in text, text
    assert "2 checkpoint(s)" in text and str(run / "step_10") in text, text
    assert f"`torch-checkpointing ls {run}`" in text and "latest_checkpoint" in text, text


def test_loading_a_runs_root_into_templates_is_no_legacy_checkpoint_with_a_missing_item(run: Path) -> None:
    """Before: read as a checkpoint without a manifest, with a MissingItemError saying to fix the item's key."""
    template = {"model": {"w": torch.zeros(4)}}
    with _manager() as manager, pytest.raises(IncompleteCheckpointError) as info:
        manager.load(str(run), into=template)
    assert str(run / "step_10") in str(info.value), info.value
    assert torch.equal(template["model"]["w"], torch.zeros(4))


def test_inspect_of_a_runs_root_names_its_newest_checkpoint(run: Path) -> None:
    done = _python("-m", "torch_checkpointing", "inspect", str(run))
    assert done.returncode == 2, done.stderr
    assert str(run / "step_10") in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_loading_a_killed_saves_temporary_names_the_id_and_gc(run: Path) -> None:
    temporary = run / ".step_12.tmp-0123456789ab-3"  # what a save of run/step_12 killed mid-write leaves
    temporary.mkdir()
    (temporary / INCOMPLETE_MARKER).touch()
    (temporary / "model_0.pt").write_bytes(b"half")
    text = _load_error(temporary)
    assert "did not commit" in text and f"load {run / 'step_12'}" in text, text
    assert f"`torch-checkpointing gc {run}`" in text, text


def test_a_directory_that_tells_nothing_keeps_the_plain_message(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert _load_error(tmp_path / "empty") == f"{tmp_path / 'empty'}: no manifest.json: not a checkpoint"
    assert os.listdir(tmp_path / "empty") == []


def test_an_incomplete_checkpoint_is_refused_without_looking_into_its_subdirectories(tmp_path: Path) -> None:
    """The hint of an incomplete checkpoint comes from its name alone. Before, its refusal looked for a run's
    checkpoints inside it, and each incomplete directory there was refused the same way in turn: nested marked
    directories (a crafted tree, or saves written under a killed save's directory) made the load raise
    RecursionError instead of IncompleteCheckpointError, and every refusal read the whole tree below it."""
    checkpoint = tmp_path / "run" / "step_3"
    level = checkpoint
    for _ in range(400):
        level.mkdir(parents=True)
        (level / INCOMPLETE_MARKER).touch()
        level = level / "d"
    text = _load_error(checkpoint)
    assert text.startswith(f"Checkpoint {checkpoint} is incomplete"), text
    assert "checkpoint(s)" not in text, text


# Loads a run's root in a child whose audit hook counts the manifests opened; prints the count, then the error.
COUNTING_CHILD = """
import sys
opened = []
sys.addaudithook(lambda event, args: opened.append(args[0]) if event == "open" and str(args[0]).endswith(
    "manifest.json") else None)
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import IncompleteCheckpointError
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
    try:
        manager.load(sys.argv[1])
    except IncompleteCheckpointError as exc:
        print(len(opened))
        print(exc)
"""


def test_the_hint_for_a_large_root_reads_a_bounded_number_of_manifests(run: Path) -> None:
    """Before: the refusal of a run's root read the manifest of every directory in it, so passing the root of a
    long run (on an object store: requests per checkpoint, and per file for an in-progress save's prefix, which
    takes the same path) took as long as listing every checkpoint before it said "not a checkpoint"."""
    with _manager() as manager:
        for step in range(11, 211):
            manager.save(str(run / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}})
    done = _python("-c", COUNTING_CHILD, str(run))
    count, _, text = done.stdout.partition("\n")
    assert done.returncode == 0 and count.isdigit(), done.stderr[-2000:]
    assert int(count) <= 2 * HINT_ENTRIES, done.stdout
    assert str(run / "step_210") in text and "torch-checkpointing ls" in text, text
