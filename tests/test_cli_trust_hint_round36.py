"""A CLI command refusing a pickled user class offers what a CLI user can do (round 36).

`torch-checkpointing diff` of checkpoints holding a class torch's safe loader does not allow said "opt in with
CheckpointManager.Config(load=CheckpointLoaderConfig(weights_only=False))": an option of `load()`, which the CLI
does not have. The refusal now says the command reads with the safe loader only, for safety, and how to read
the checkpoint from Python, trusting its files. A load keeps its own fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli import _cli
from torch_checkpointing import CheckpointLoaderConfig, CheckpointManager, RefusedPickleError
from torch_checkpointing.config import SyncCheckpointSaverConfig


class NotAllowed:
    """A user class: torch's safe loader refuses its global."""

    def __init__(self) -> None:
        self.x = 1


def _save(checkpoint: Path) -> Path:
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig())
    with CheckpointManager(config) as manager, pytest.warns(UserWarning, match="NotAllowed"):
        manager.save(str(checkpoint), {"model": {"o": NotAllowed()}})
    return checkpoint


def test_cli_diff_of_a_disallowed_global_offers_what_the_cli_can_do(tmp_path: Path) -> None:
    a, b = _save(tmp_path / "a"), _save(tmp_path / "b")
    done = _cli("diff", str(a), str(b))
    assert done.returncode == 2, done
    said = done.stderr
    assert "NotAllowed" in said and str(a / "model_0.pt") in said, said
    assert "opt in" not in said, said  # to an option the CLI has no flag for
    assert "for safety" in said and "no option" in said, said  # refused for safety, and the CLI cannot trust it
    assert "in Python" in said and "weights_only=False" in said, said  # how to read it, trusting the file


def test_a_load_of_a_disallowed_global_keeps_its_opt_in(tmp_path: Path) -> None:
    checkpoint = _save(tmp_path / "a")
    with CheckpointManager(CheckpointManager.Config()) as manager, pytest.raises(RefusedPickleError) as refused:
        manager.load(str(checkpoint), {"model": {"o": None}})
    assert "CheckpointManager.Config(load=CheckpointLoaderConfig(weights_only=False))" in str(refused.value)
    trusting = CheckpointManager.Config(load=CheckpointLoaderConfig(weights_only=False))
    with CheckpointManager(trusting) as manager:
        assert isinstance(manager.load(str(checkpoint), {"model": {"o": None}})["model"]["o"], NotAllowed)
