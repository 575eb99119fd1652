"""Integer arguments whose value cannot be read, and public rank arguments taken unconverted (round 32)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.test_integer_arguments_round31 import _ARGUMENTS
from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigTypeError


def _fake_scalar() -> torch.Tensor:
    """A 0-d integer tensor of torch's fake mode (a traced or compiled step counter): it has a dtype and a shape,
    but no value, and its `__index__` raises torch's DataDependentOutputException, a RuntimeError."""
    with FakeTensorMode():
        return torch.empty((), dtype=torch.int64)


@pytest.mark.parametrize(("name", "build"), _ARGUMENTS, ids=[n for n, _ in _ARGUMENTS])
def test_an_integer_whose_value_cannot_be_read_is_refused_as_a_config_error(
    name: str, build: Callable[[Any], Any]
) -> None:
    """Defect: torch's bare DataDependentOutputException "aten._local_scalar_dense.default" escaped, naming
    neither the argument nor the fix (only a TypeError from `__index__` was taken as "no integer")."""
    with pytest.raises(ConfigTypeError, match=re.findall(r"\w+", name)[-1]):
        build(_fake_scalar())


def test_save_step_whose_value_cannot_be_read_is_refused_naming_step(tmp_path: Path) -> None:
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
    with CheckpointManager(config) as manager, pytest.raises(ConfigTypeError, match="step"):
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}}, step=_fake_scalar())
    assert list_checkpoints(tmp_path) == []
