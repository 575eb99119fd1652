"""A RankInfo stays what its validation made it: the barrier (and every other holder) keeps the object it got.

Before, the four fields were plain attributes: a `TCPStoreBarrier` built with a checked `RankInfo(0, 2, 0, 2)`
published its arrivals under whatever the caller assigned later (`info.role_rank = True`: under "1/True", the
very mix-up `RankInfo.__post_init__` refuses at construction; `info.role_rank = 5`: a rank outside its world).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.types import RankInfo


@pytest.mark.parametrize("field", ["global_rank", "global_world_size", "role_rank", "role_world_size"])
@pytest.mark.parametrize("value", [True, 5, "0"])
def test_a_field_cannot_be_reassigned_after_validation(field: str, value: object) -> None:
    info = RankInfo(0, 2, 0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(info, field, value)
    assert (info.global_rank, info.global_world_size, info.role_rank, info.role_world_size) == (0, 2, 0, 2)


def test_replace_is_validated_and_keeps_the_plain_int() -> None:
    """`dataclasses.replace` is how another rank's RankInfo is made now: checked as a new one is."""
    info = dataclasses.replace(RankInfo(0, 2, 0, 2), role_rank=np.int64(1))
    assert type(info.role_rank) is int and info.role_rank == 1
    with pytest.raises(ConfigError, match="RankInfo.role_rank=2 is outside its world"):
        dataclasses.replace(info, role_rank=2)


def test_a_rank_info_is_hashable_and_equal_by_value() -> None:
    assert {RankInfo(0, 2, 0, 2), RankInfo(0, 2, 0, 2)} == {RankInfo(0, 2, 0, 2)}


def test_a_managers_rank_info_cannot_be_edited_under_it(tmp_path: Path) -> None:
    """`manager.rank_info` is the object the manager's rank context and loader hold: before, assigning to it
    (`manager.rank_info.global_rank = 3` in a one-process job) made that manager load and plan as rank 3."""
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        with pytest.raises(dataclasses.FrozenInstanceError):
            manager.rank_info.global_rank = 3  # type: ignore[misc]
        assert manager.rank_info == RankInfo(0, 1, 0, 1)
        manager.save(str(tmp_path / "a"), {"m": {"x": torch.ones(2)}})
        assert torch.equal(manager.load(str(tmp_path / "a"))["m"]["x"], torch.ones(2))
