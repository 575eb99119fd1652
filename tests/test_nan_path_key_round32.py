"""A NaN dict key of numpy's floats is refused at save, as Python's float NaN is (round 32).

Round 31 refused a dict key that is or holds a float NaN, searching only dicts with a key of type exactly
`float` or `tuple`: a key that is numpy's NaN (`np.float64`, a float subclass, or `np.float32`, no float) was
saved, and the load restored its entry "partially": NaN equals nothing, the key saved under included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError

_NANS = [np.float64("nan"), np.float32("nan"), np.float16("nan"), (1, np.float32("nan"))]


def _manager() -> CheckpointManager:
    """weights_only=False: torch's safe loader refuses every numpy scalar, a key too."""
    load = CheckpointLoaderConfig(weights_only=False)
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=load))


@pytest.mark.parametrize("key", _NANS, ids=["float64", "float32", "float16", "float32-in-a-tuple"])
def test_save_refuses_a_numpy_nan_dict_key(tmp_path: Path, key: Any) -> None:
    """Defect: the save committed, and a load into the template holding that very key object restored it
    "partially" (reported missing and extra at once)."""
    with _manager() as manager, pytest.raises(ConfigError, match=r"item 'm'.*NaN.*Rename"):
        manager.save(str(tmp_path / "ck"), {"m": {"a": {key: torch.ones(2)}}})
    assert list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("key", [np.float64(0.5), np.float32(0.5), np.float64("inf")], ids=repr)
def test_a_numpy_float_key_that_is_a_number_is_saved(tmp_path: Path, key: Any) -> None:
    with _manager() as manager:
        manager.save(str(tmp_path / "ck"), {"m": {"a": {key: torch.ones(2)}}})
        into = {"m": {"a": {key: torch.zeros(2)}}}
        manager.load(str(tmp_path / "ck"), into)
    assert torch.equal(into["m"]["a"][key], torch.ones(2))
