"""A `pathlib.Path` is taken as pathlib takes it: its `~` is a folder of that name, never the home directory.

`Path("./~/run")` is `~/run` to pathlib (it drops the `./`), and every entry expanded a leading `~` of the
path it was given, so `delete_checkpoint(Path("./~/run/step_3"))` deleted `$HOME/run/step_3`, a checkpoint the
caller never named, and `prune(Path("./~/run"), ...)` pruned the home directory's run. A `str` keeps the shell's
reading (`"~/run"` is the home directory, `"./~/run"` the folder); a Path is literal, as `open()` and pathlib
read it (call `.expanduser()` for the home directory).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.home_dirs import home_and_work
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig, list_checkpoints
from torch_checkpointing.hf import export_hf
from torch_checkpointing.retention import RetentionPolicy, delete_checkpoint, prune


def _save(manager: CheckpointManager, where: str | os.PathLike[str], step: int) -> None:
    manager.save(where, {"m": {"x": torch.full((2,), float(step))}}, step=step)


@pytest.fixture
def two_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """Steps 1..3 under a folder literally named `~` in the working directory, and under $HOME/run."""
    home, work = home_and_work(tmp_path, monkeypatch)
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2, 3):
            _save(manager, f"./~/run/step_{step}", step)
            _save(manager, f"~/run/step_{step}", step)
    return work / "~" / "run", home / "run"


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if not p.name.startswith("."))


def test_delete_checkpoint_of_a_path_never_deletes_under_home(two_runs: tuple[Path, Path]) -> None:
    literal, home = two_runs
    delete_checkpoint(Path("./~/run/step_3"))
    assert _steps(home) == ["step_1", "step_2", "step_3"]
    assert _steps(literal) == ["step_1", "step_2"]


def test_prune_and_listing_of_a_path_read_the_folder_named_tilde(two_runs: tuple[Path, Path]) -> None:
    literal, home = two_runs
    assert [os.path.basename(c.path) for c in list_checkpoints(Path("./~/run"))] == ["step_1", "step_2", "step_3"]
    prune(Path("./~/run"), RetentionPolicy(keep_last=1))
    assert _steps(home) == ["step_1", "step_2", "step_3"]
    assert _steps(literal) == ["step_3"]


def test_a_manager_given_paths_saves_loads_and_retains_under_the_folder(two_runs: tuple[Path, Path]) -> None:
    literal, home = two_runs
    policy = RetentionPolicy(root=Path("./~/run"), keep_last=2)
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), retention=policy)
    with CheckpointManager(config) as manager:
        _save(manager, Path("./~/run/step_4"), 4)
        restored = manager.load(Path("./~/run/step_4"), into={"m": {"x": torch.zeros(2)}})
    assert torch.equal(restored["m"]["x"], torch.full((2,), 4.0))
    assert _steps(home) == ["step_1", "step_2", "step_3"]
    assert _steps(literal) == ["step_3", "step_4"]


def test_export_hf_to_a_path_writes_under_the_folder(two_runs: tuple[Path, Path]) -> None:
    literal, home = two_runs
    export_hf(Path("./~/run/step_2"), "m", Path("./~/hf"))
    assert (literal.parent / "hf").is_dir()
    assert not (home.parent / "hf").exists()
