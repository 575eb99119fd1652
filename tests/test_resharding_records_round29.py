"""The resharding records refuse a field of the wrong type naming it (round 29), as the sharding records do.

`LoadPlan` and `ReshardingInfo` took anything: a plan with `src_rank="1"` or `sizes="22"` failed later, in the
copy, far from the plan that was wrong (or named a file that was never written), and a `ReshardingInfo` whose
paths were not nested paths was reported as missing paths nobody saved. `DistributedItemMetadata.get_file_path`
raised a bare TypeError for a path of the wrong type, and for a str or bool rank named a file "k_0.pt" /
"k_True.pt" from its default layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torch_checkpointing.distributed_metadata import DistributedItemMetadata
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.resharding import LoadPlan, ReshardingInfo

_PLAN: dict[str, Any] = {
    "offsets": (0, 0),
    "sizes": (2, 2),
    "src_rank": 1,
    "src_fqn": "w",
    "src_offsets": (0, 0),
    "src_sizes": (2, 2),
}


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("offsets", "00", ConfigTypeError),
        ("sizes", (2, 2.0), ConfigTypeError),
        ("src_offsets", (0, -1), ConfigError),
        ("src_sizes", None, ConfigTypeError),
        ("sizes", (2,), ConfigError),  # one entry per dimension, in each of the four
        ("src_rank", "1", ConfigTypeError),
        ("src_rank", True, ConfigTypeError),
        ("src_rank", -1, ConfigError),
        ("src_fqn", ("w",), ConfigTypeError),
        ("src_elem_size", 4.0, ConfigTypeError),
        ("src_dtype", None, ConfigTypeError),
        ("transpose_dims", "10", ConfigTypeError),
    ],
)
def test_a_load_plan_refuses_a_field_of_the_wrong_type_naming_it(field: str, value: Any, kind: type) -> None:
    """Defect: every one of these was accepted (no exception at all)."""
    with pytest.raises(kind) as refused:
        LoadPlan(**{**_PLAN, field: value})
    assert "LoadPlan" in str(refused.value) and field.rstrip("s").split("_")[-1] in str(refused.value)


def test_a_load_plan_of_lists_is_the_plan_of_tuples() -> None:
    """Lists are taken as the tuples the fields are: the two plans are equal."""
    listed = LoadPlan(**{k: list(v) if isinstance(v, tuple) else v for k, v in _PLAN.items()})
    assert listed == LoadPlan(**_PLAN) and listed.numel == 4


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"nested_path_to_load_plans": [("w",)]}, "nested_path_to_load_plans"),
        ({"nested_path_to_load_plans": {"w": []}}, "nested_path_to_load_plans key"),
        ({"nested_path_to_load_plans": {("w",): LoadPlan(**_PLAN)}}, "nested_path_to_load_plans[('w',)]"),
        ({"nested_path_to_load_plans": {("w",): [_PLAN]}}, "nested_path_to_load_plans[('w',)]"),
        ({"non_reshardable_paths": ("w",)}, "non_reshardable_paths"),
        ({"non_reshardable_paths": ["w"]}, "non_reshardable_paths entry"),
        ({"non_reshardable_paths": [("w", ["x"])]}, "non_reshardable_paths entry"),
    ],
)
def test_resharding_info_refuses_a_field_of_the_wrong_type_naming_it(kwargs: dict[str, Any], named: str) -> None:
    """Defect: every one of these was accepted (no exception at all)."""
    with pytest.raises(ConfigTypeError) as refused:
        ReshardingInfo(**kwargs)
    assert f"ReshardingInfo.{named}" in str(refused.value)


def test_resharding_info_takes_what_it_is() -> None:
    info = ReshardingInfo({("layers", 0, "w"): [LoadPlan(**_PLAN)]}, [("b",)])
    assert info.non_reshardable_paths == [("b",)] and ReshardingInfo() == ReshardingInfo({}, [])


@pytest.mark.parametrize(
    ("args", "kind", "named"),
    [
        (("0", Path("/ck"), "k"), ConfigTypeError, "rank"),
        ((True, Path("/ck"), "k"), ConfigTypeError, "rank"),
        ((-1, Path("/ck"), "k"), ConfigError, "rank"),
        ((0, 5, "k"), ConfigTypeError, "checkpoint_path"),
        ((0, Path("/ck"), Path("k")), ConfigTypeError, "item_key"),
    ],
)
def test_get_file_path_refuses_an_argument_of_the_wrong_type_naming_it(args: tuple, kind: type, named: str) -> None:
    """Defect: "TypeError: expected str, bytes or os.PathLike object, not int" for the path; for a str or bool
    rank, the file "/ck/k_0.pt" or "/ck/k_True.pt" and no error."""
    item = DistributedItemMetadata({}, {0: None})
    with pytest.raises(kind, match=f"get_file_path.*{named}"):
        item.get_file_path(*args)
    assert item.get_file_path(0, "/ck", "k") == Path("/ck/k_0.pt")
