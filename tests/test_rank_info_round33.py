"""`RankInfo` (what a `TCPStoreBarrier`, a `CheckpointLoader` and a custom resharder are told of this process) is
four ints: a bool or a non-integer is refused naming the field, an integer scalar taken as its int (round 33).

`RankInfo(True, 2, True, 2)` was taken, and `True == 1` everywhere but in a name: the barrier published its
arrival as `0/True` while rank 0 waited for `0/1`, so the barrier timed out naming rank 1 as never arrived.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.types import RankInfo

_FIELDS = ["global_rank", "global_world_size", "role_rank", "role_world_size"]
_GOOD = {"global_rank": 1, "global_world_size": 2, "role_rank": 1, "role_world_size": 2}


@pytest.mark.parametrize("value", [True, np.bool_(True), torch.tensor(True), 1.0, "1", None], ids=repr)
@pytest.mark.parametrize("field", _FIELDS)
def test_a_field_that_is_no_int_is_refused_naming_it(field: str, value: Any) -> None:
    """Defect: RankInfo(True, 2, True, 2) was taken; a barrier built with it published its arrival as `0/True`."""
    with pytest.raises(ConfigTypeError, match=f"RankInfo.{field}"):
        RankInfo(**{**_GOOD, field: value})


@pytest.mark.parametrize("field", _FIELDS)
def test_an_integer_scalar_is_taken_as_its_int(field: str) -> None:
    info = RankInfo(**{**_GOOD, field: np.int64(_GOOD[field])})
    assert type(getattr(info, field)) is int and info == RankInfo(**_GOOD)


@pytest.mark.parametrize(
    "args", [(2, 2, 0, 2), (0, 2, 2, 2), (-1, 2, 0, 2), (0, 0, 0, 1), (0, 1, 0, 0)], ids=lambda a: repr(a)
)
def test_a_rank_outside_its_world_is_refused(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ConfigError, match="RankInfo"):
        RankInfo(*args)


def test_single_is_rank_0_of_1() -> None:
    assert RankInfo.single() == RankInfo(0, 1, 0, 1)
