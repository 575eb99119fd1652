"""A construction-only value that is NaN as a numpy or torch scalar, left as it was, is no change (round 35).

The check that a construction-only field kept its value takes a number as the plain float it stands for (so that
`np.int64(5)` set on a field built as 5 is no change). A NaN taken so is a new float at each look, and NaN is
never equal to itself: `subprocess_init_args=(np.float64("nan"),)`, never touched, failed the next save with
"subprocess_init_args[0] was changed after this manager was built".
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError


def _manager(args: tuple[Any, ...]) -> CheckpointManager:
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(wait_timeout_secs=5), subprocess_init_args=args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a sync saver has no writer process to pass them to: it says so
        return CheckpointManager(config)


@pytest.mark.parametrize("nan", [np.float64("nan"), np.float32("nan"), torch.tensor(float("nan"))])
def test_a_nan_scalar_left_as_it_was_is_no_change(nan: Any, tmp_path: Path) -> None:
    with _manager((nan,)) as manager:
        manager.save(str(tmp_path / "a"), {"m": {"x": torch.ones(2)}})  # before: ConfigError "was changed"
        manager.save(str(tmp_path / "b"), {"m": {"x": torch.ones(2)}})


def test_a_nan_replaced_by_a_number_is_still_a_change(tmp_path: Path) -> None:
    with _manager((np.float64("nan"),)) as manager:
        manager.config.subprocess_init_args = (1.0,)
        with pytest.raises(ConfigError, match=r"subprocess_init_args\[0\]"):
            manager.save(str(tmp_path / "a"), {"m": {"x": torch.ones(2)}})
