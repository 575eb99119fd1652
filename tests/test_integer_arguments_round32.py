"""Integer arguments whose value cannot be read, and public rank arguments taken unconverted (round 32)."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.test_integer_arguments_round31 import _ARGUMENTS
from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.checkpoint_layout import default_layout_info
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.dtensor_metadata import get_device_mesh_spec
from torch_checkpointing.errors import ConfigTypeError


class _Two(enum.IntEnum):
    TWO = 2


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


_MESH = get_device_mesh_spec("cpu", (2, 2), (0, 2, 1, 3))


@pytest.mark.parametrize(
    "rank", [np.int64(2), torch.tensor(2), np.array(2), _Two.TWO], ids=["int64", "tensor", "array", "IntEnum"]
)
def test_get_coordinate_takes_an_integer_scalar(rank: Any) -> None:
    """Defect: `get_coordinate(torch.tensor(2))` returned None (a tensor hashes by identity: no such key), the
    answer for a rank outside the mesh, so a resharder asking it read nothing for a rank that holds a shard."""
    coordinate = _MESH.get_coordinate(rank)
    assert coordinate == (0, 1)
    assert all(type(c) is int for c in coordinate)


@pytest.mark.parametrize(
    "rank", [np.int64(-1), np.int64(4), torch.tensor(-1)], ids=["int64-negative", "int64-out", "tensor"]
)
def test_get_coordinate_of_an_integer_scalar_outside_the_mesh_is_none(rank: Any) -> None:
    assert _MESH.get_coordinate(rank) is None and _MESH.get_coordinate(int(rank)) is None


@pytest.mark.parametrize("rank", [True, np.bool_(True), torch.tensor(True), 2.0, "2"])
def test_get_coordinate_refuses_what_is_no_rank(rank: Any) -> None:
    """Defect: `get_coordinate(True)` gave rank 1's coordinate (True == 1 as a dict key); 2.0 gave rank 2's."""
    with pytest.raises(ConfigTypeError, match="rank"):
        _MESH.get_coordinate(rank)


@pytest.mark.parametrize("rank", [np.int64(3), torch.tensor(3), _Two.TWO + 1], ids=["int64", "tensor", "IntEnum"])
def test_default_layout_info_names_an_integer_scalar_rank_by_its_int(rank: Any) -> None:
    assert default_layout_info("m", rank).file_path == "m_3.pt"


@pytest.mark.parametrize("rank", [True, np.bool_(True), torch.tensor(True), 1.0, "1"])
def test_default_layout_info_refuses_what_is_no_rank(rank: Any) -> None:
    """Defect: `default_layout_info("m", True)` named the file "m_True.pt" (1.0: "m_1.0.pt"), a file no rank
    writes: the layout every load of rank 1's default file looks up."""
    with pytest.raises(ConfigTypeError, match="rank"):
        default_layout_info("m", rank)
