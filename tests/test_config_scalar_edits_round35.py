"""A construction-only field set to the value it had, as a numpy or torch scalar, is no change.

A config's numbers are taken as the plain int or float they stand for (numpy's integers, a 0-d tensor:
`integer_as_int`, `real_as_number`), at construction and at each check after an edit. The check that a
construction-only field kept its value compared the user's object itself: `np.int64(5)` set on a field built as
5 was refused as "changed after this manager was built", with the advice to set it back, which it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError


@pytest.mark.parametrize("same", [np.int64(5), np.float32(5.0), torch.tensor(5), torch.tensor(5.0), 5.0])
def test_a_field_set_to_its_value_as_another_number_type_is_no_change(same: Any, tmp_path: Path) -> None:
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(wait_timeout_secs=5))
    with CheckpointManager(config) as manager:
        config.save.wait_timeout_secs = same
        manager.save(str(tmp_path / "a"), {"m": {"x": torch.ones(2)}})  # before: ConfigError "was changed"


@pytest.mark.parametrize("other", [np.int64(6), torch.tensor(5.5), np.bool_(True)])
def test_a_field_set_to_another_value_as_a_scalar_is_still_refused(other: Any, tmp_path: Path) -> None:
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(wait_timeout_secs=5))
    with CheckpointManager(config) as manager:
        config.save.wait_timeout_secs = other
        with pytest.raises(ConfigError, match="wait_timeout_secs"):
            manager.save(str(tmp_path / "a"), {"m": {"x": torch.ones(2)}})
        config.save.wait_timeout_secs = 5
