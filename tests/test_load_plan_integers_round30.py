"""A resharder's plan computed with numpy's integers is the plan of the ints they stand for (round 30).

Round 29 made `LoadPlan` refuse a field of the wrong type, and took "int" to mean `type(v) is int`: a custom
resharder that computes its blocks with numpy (`np.cumsum` of the shard sizes, `np.int64` offsets), whose plans
loaded before (torch slices with any `__index__` integer), was refused with a `ConfigTypeError` at every load.
A bool, a float or a str is still refused (tests/test_resharding_records_round29.py).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import pytest

from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.resharding import LoadPlan

_PLAN: dict[str, Any] = {
    "offsets": (0, 2),
    "sizes": (2, 2),
    "src_rank": 1,
    "src_fqn": "w",
    "src_offsets": (0, 0),
    "src_sizes": (2, 2),
    "src_elem_size": 4,
}


class _Rank(enum.IntEnum):
    ONE = 1


def _numpy(kind: Any) -> dict[str, Any]:
    """The plan's every int field as numpy's integer `kind`."""
    return {
        k: tuple(map(kind, v)) if isinstance(v, tuple) else v if k == "src_fqn" else kind(v) for k, v in _PLAN.items()
    }


@pytest.mark.parametrize(
    "fields",
    [_numpy(np.int64), _numpy(np.int32), _numpy(np.uint16), {**_PLAN, "src_rank": _Rank.ONE}],
    ids=["int64", "int32", "uint16", "IntEnum"],
)
def test_a_plan_of_integers_is_the_plan_of_ints(fields: dict[str, Any]) -> None:
    """Defect: ConfigTypeError "LoadPlan.offsets must hold ints only, got int64 np.int64(0)"; an IntEnum rank was
    kept as the enum ("assert (<enum '_Rank'> is int)")."""
    plan = LoadPlan(**fields)
    assert plan == LoadPlan(**_PLAN)
    assert all(type(v) is int for v in (*plan.offsets, *plan.sizes, *plan.src_offsets, *plan.src_sizes))
    assert type(plan.src_rank) is int and type(plan.src_elem_size) is int


@pytest.mark.parametrize("value", [np.float64(1.0), np.bool_(True), True])
def test_a_plan_still_refuses_what_is_not_an_integer(value: Any) -> None:
    with pytest.raises(ConfigTypeError, match="src_rank"):
        LoadPlan(**{**_PLAN, "src_rank": value})


def test_get_file_path_takes_a_numpy_rank() -> None:
    """Defect: ConfigTypeError "DistributedItemMetadata.get_file_path.rank must be an int, got int64 np.int64(1)"
    (round 29's check; before it, the rank found its layout)."""
    from pathlib import Path

    from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
    from torch_checkpointing.distributed_metadata import DistributedItemMetadata

    metadata = DistributedItemMetadata({}, {1: LayoutInfo("k_of_one.pt", TorchSerialization())})
    assert metadata.get_file_path(np.int64(1), Path("ck"), "k") == Path("ck/k_of_one.pt")
