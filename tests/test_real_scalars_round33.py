"""A number of seconds held in a 0-d float tensor or 0-d numpy float array is taken as its float (round 33).

Round 33 took any real number but a bool as seconds, and an integer scalar (a 0-d int tensor, numpy's 0-d int
array) was already taken as its int: `wait_timeout_secs=torch.tensor(2)` was 2. The same value as a float,
`torch.tensor(2.0)` (a timeout computed with torch: a mean of measured durations), was refused as "must be a
number of seconds", as was `np.array(1.5)`. A bool tensor, a tensor of more than one element and a complex one
are still refused, naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.test_real_seconds_round33 import _IDS, _SECONDS
from torch_checkpointing.errors import ConfigTypeError

_SCALARS = [
    torch.tensor(1.5),
    torch.tensor(1.5, dtype=torch.float16),
    torch.tensor(1.5).requires_grad_(),
    np.array(1.5),
]


@pytest.mark.parametrize("value", _SCALARS, ids=lambda v: f"{type(v).__name__}-{v.dtype}")
@pytest.mark.parametrize(("name", "build"), _SECONDS, ids=_IDS)
def test_a_float_scalar_is_taken_as_its_float(name: str, build: Callable[[Any], Any], value: Any) -> None:
    kept = build(value)
    assert kept == 1.5
    assert type(kept) is float  # what a config pickled to the writer process or dumped as JSON holds


_NOT_SECONDS = [torch.tensor(True), torch.tensor([1.5, 2.5]), torch.tensor(1.5 + 0j), np.array([1.5]), np.array(True)]


@pytest.mark.parametrize("value", _NOT_SECONDS, ids=repr)
@pytest.mark.parametrize(("name", "build"), _SECONDS, ids=_IDS)
def test_other_tensors_are_still_refused_naming_the_argument(
    name: str, build: Callable[[Any], Any], value: Any
) -> None:
    with pytest.raises(ConfigTypeError) as caught:
        build(value)
    assert name.split(".")[-1].split("(")[0] in str(caught.value)
