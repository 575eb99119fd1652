"""Only an integer scalar stands for an int in a plan or a rank, no bool tensor or one-element array (round 31).

Round 30 took any value with `__index__` (that is not a bool by its type's name) for the int it gives. torch's
`Tensor.__index__` also gives one for a 0-d bool tensor (`torch.tensor(True)`, the result of a comparison) and for
a one-element tensor of any shape: a plan's `src_rank=torch.tensor(True)` read shard 1 while `True` and
`np.bool_(True)` are refused, and a `sizes=torch.tensor([2])` was refused as "got int 2", naming a value the caller
never gave. numpy refuses a one-element array (`np.array([1])`) itself; torch's is refused the same way now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.resharding import LoadPlan

_PLAN: dict[str, Any] = {
    "offsets": (0,),
    "sizes": (2,),
    "src_rank": 0,
    "src_fqn": "w",
    "src_offsets": (0,),
    "src_sizes": (2,),
    "src_elem_size": 4,
}


@pytest.mark.parametrize(
    "value",
    [torch.tensor(True), torch.tensor([1]), torch.tensor([[1]]), np.array([1])],
    ids=["bool-tensor", "1-element-tensor", "1x1-tensor", "1-element-array"],
)
def test_a_rank_that_is_no_integer_scalar_is_refused(value: Any) -> None:
    """Defect: `LoadPlan(src_rank=torch.tensor(True))` made the plan of `src_rank=1` (DID NOT RAISE)."""
    with pytest.raises(ConfigTypeError, match=r"src_rank must be an int, got (Tensor|ndarray)"):
        LoadPlan(**{**_PLAN, "src_rank": value})


def test_a_tensor_of_sizes_is_refused_as_the_tensor_it_is() -> None:
    """Defect: ConfigTypeError "LoadPlan.sizes must be a tuple of ints, got int 2"."""
    with pytest.raises(ConfigTypeError, match=r"sizes must be a tuple of ints, got Tensor"):
        LoadPlan(**{**_PLAN, "sizes": torch.tensor([2])})


@pytest.mark.parametrize("value", [torch.tensor(0), torch.tensor(1, dtype=torch.int32), np.array(1)])
def test_a_0d_integer_tensor_or_array_is_still_its_int(value: Any) -> None:
    plan = LoadPlan(**{**_PLAN, "src_rank": value})
    assert type(plan.src_rank) is int and plan.src_rank == int(value)


def test_get_file_path_refuses_a_bool_tensor_rank() -> None:
    """Defect: `get_file_path(torch.tensor(True), ...)` named rank 1's file (ck/k_1.pt)."""
    from torch_checkpointing.distributed_metadata import DistributedItemMetadata

    with pytest.raises(ConfigTypeError, match="rank"):
        DistributedItemMetadata({}, {}).get_file_path(torch.tensor(True), Path("ck"), "k")
