"""Nothing a user asks for is written inside one of the engine's working directories.

A save killed with SIGKILL leaves its temporary (`.{id}.tmp-{uid}-{seq}`); `gc` (and every retention pass) removes
that folder whole once its save is gone, as it removes a deletion's trash and a replaced copy aside. An HF export
or a checkpoint put inside one was accepted (exit 0, "exported ... to" it; the save committed) and then went with
it at the next gc. Both are refused up front, naming the working directory, with nothing written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import CommitError, ConfigError
from torch_checkpointing.hf import export_hf
from torch_checkpointing.names import TMP_RE

ROOT = Path(__file__).resolve().parent.parent
_SAVER = """
import sys, torch
from torch_checkpointing import CheckpointManager
manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
manager.save(sys.argv[1], {"model": {"w": torch.ones(2**25)}})
"""


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _killed_save(run: Path) -> Path:
    """The temporary a real save leaves when SIGKILLed while it writes (polled for, then killed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(run / "step_3")], cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            found = [p for p in run.iterdir() if TMP_RE.match(p.name)] if run.is_dir() else []
            # killed once its claim is in: a bare folder of that name holds nothing gc (or the refusal) calls ours
            if found and (found[0] / ".incomplete").exists():
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                return found[0]
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    pytest.fail(f"the save never made its temporary (exit {proc.returncode})")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A run's root holding one committed checkpoint and a killed save's temporary."""
    root = tmp_path_factory.mktemp("working_dirs") / "run"
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    try:
        manager.save(str(root / "step_2"), {"model": {"w": torch.arange(6.0)}})
    finally:
        manager.close()
    return root, _killed_save(root)


def _tree(path: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, dirs, files in os.walk(path) for n in dirs + files)


def test_cli_export_into_a_killed_saves_temporary_is_refused(run: tuple[Path, Path]) -> None:
    root, temporary = run
    before = _tree(root)
    done = _run("-m", "torch_checkpointing", "export", str(root / "step_2"), "--item", "model", "--to", "hf",
                str(temporary / "hf"))  # fmt: skip
    assert done.returncode == 2, done.stdout
    assert str(temporary) in done.stderr and "gc" in done.stderr, done.stderr
    assert _tree(root) == before


@pytest.mark.parametrize("name", [".step_1.trash-4242-0a1b2c3d", ".old_step_1_4242-0a1b2c3d"])
def test_export_into_trash_or_aside_is_refused(run: tuple[Path, Path], tmp_path: Path, name: str) -> None:
    """A committed checkpoint renamed as a deletion (trash) or a replace (aside) renames it; gc removes both."""
    root, _ = run
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    try:
        manager.save(str(tmp_path / "step_1"), {"model": {"w": torch.ones(2)}})
    finally:
        manager.close()
    working = tmp_path / name
    (tmp_path / "step_1").rename(working)
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        export_hf(root / "step_2", "model", working / "hf")
    assert _tree(tmp_path) == before


def test_a_users_folder_so_named_is_no_working_directory(run: tuple[Path, Path], tmp_path: Path) -> None:
    """A name is no proof: a folder of the user's holding neither a manifest nor the marker takes the export."""
    root, _ = run
    report = export_hf(root / "step_2", "model", tmp_path / ".old_runs_2" / "hf")
    assert report.tensors == 1


def test_save_inside_a_killed_saves_temporary_is_refused(run: tuple[Path, Path]) -> None:
    root, temporary = run
    before = _tree(root)
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    try:
        with pytest.raises(CommitError, match="gc"):
            manager.save(str(temporary / "inner"), {"model": {"w": torch.ones(2)}})
    finally:
        manager.close()
    assert _tree(root) == before
