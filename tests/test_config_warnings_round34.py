"""A config's FutureWarning (an ignored field set) is given once per config object, where the user set it.

Round 33's `config.recheck` runs the engine's `__post_init__`s again at each manager build, to refuse a field
edited since construction. Their warnings came again with them: a script building one manager per evaluation
from one config was told "barrier_config is ignored" once per manager under `-W always`, and, under the default
filters, once more at a line inside the engine (the warning's stack level pointed into `recheck`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import torch_checkpointing
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.config import CheckpointWriterConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

_MANAGERS = 3
_SAID = "checkpoint_write_barrier_timeout_sec is ignored"


def _build_managers(config: CheckpointManager.Config, root: Path) -> None:
    for step in range(_MANAGERS):
        with CheckpointManager(config) as manager:
            manager.save(str(root / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)


def _told(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, FutureWarning) and _SAID in str(w.message)]


def test_a_config_built_with_an_ignored_field_warns_once_for_all_its_managers(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=5)
        config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(writer_config=writer))
        _build_managers(config, tmp_path)
    told = _told(caught)
    assert len(told) == 1, [str(w.message) for w in told]
    assert told[0].filename == __file__, told[0].filename


def test_an_edit_to_an_ignored_field_warns_once_at_the_next_build(tmp_path: Path) -> None:
    """`__post_init__` never saw the edit: the first manager built after it tells, at the user's line."""
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.save.writer_config.checkpoint_write_barrier_timeout_sec = 5
        _build_managers(config, tmp_path)
    told = _told(caught)
    assert len(told) == 1, [str(w.message) for w in told]
    # the first line outside the engine (here the test suite's wrapper of CheckpointManager.__init__)
    assert not told[0].filename.startswith(os.path.dirname(torch_checkpointing.__file__)), told[0].filename


_SCRIPT = f"""
import sys, torch
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.config import CheckpointWriterConfig
writer = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=5)
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(writer_config=writer))
for step in range({_MANAGERS}):
    with CheckpointManager(config) as manager:
        manager.save(sys.argv[1] + f"/step_{{step}}", {{"m": {{"x": torch.ones(2)}}}}, step=step)
"""


def _run_script(tmp_path: Path, *flags: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(
        [sys.executable, *flags, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,  # only to stop a hang
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_script_is_told_once_under_the_default_filters(tmp_path: Path) -> None:
    said = [line for line in _run_script(tmp_path).splitlines() if _SAID in line]
    assert len(said) == 1, said
    assert "train.py" in said[0], said[0]


def test_a_script_is_told_once_under_w_always(tmp_path: Path) -> None:
    said = [line for line in _run_script(tmp_path, "-W", "always").splitlines() if _SAID in line]
    assert len(said) == 1, said
    assert "train.py" in said[0], said[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is about a machine without CUDA")
def test_pinned_memory_without_cuda_is_told_once_per_config(tmp_path: Path) -> None:
    """The same for the stager's "asks for pinned memory ... CUDA is not available": given by every manager's
    stager (built from the manager's copy of the config), at a line of the engine."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = CheckpointManager.Config.with_async_save()
        config.save.staging_config.use_pinned_memory = True
        config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
        for step in range(2):
            with CheckpointManager(config) as manager:
                manager.save(str(tmp_path / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step).result(300)
    told = [w for w in caught if "asks for pinned memory" in str(w.message)]
    assert len(told) == 1, [(w.filename, w.lineno) for w in told]
    assert not told[0].filename.startswith(os.path.dirname(torch_checkpointing.__file__)), told[0].filename
