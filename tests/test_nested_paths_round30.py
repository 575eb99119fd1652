"""One nested-path check for every record that holds one: the same refusals, the same error, the same message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from torch_checkpointing.distributed_metadata import DistributedItemMetadata
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.resharding import ReshardingInfo
from torch_checkpointing.types import CheckpointPath

_RECORDS: dict[str, Callable[[Any], object]] = {
    "CheckpointPath.nested_path": lambda p: CheckpointPath("k", p),
    "ReshardingInfo.non_reshardable_paths entry": lambda p: ReshardingInfo({}, [p]),
    "ReshardingInfo.nested_path_to_load_plans key": lambda p: ReshardingInfo({p: []}, []),
    "DistributedItemMetadata.nested_path_to_metadata key": lambda p: DistributedItemMetadata({p: []}, {}),
}


@pytest.mark.parametrize("field", list(_RECORDS))
@pytest.mark.parametrize("path", ["ab", 7, None, b"ab"])
def test_every_record_refuses_a_bad_path_naming_field_value_and_fix(field: str, path: Any) -> None:
    """Each record had its own check and its own wording (one named no type, one no fix)."""
    with pytest.raises(ConfigTypeError) as refused:
        _RECORDS[field](path)
    said = str(refused.value)
    assert said.startswith(f"{field} must be a nested path") and repr(path)[:20] in said
    assert "such as ('layers', 0, 'w')" in said


def test_a_str_path_is_told_to_be_a_tuple() -> None:
    with pytest.raises(ConfigTypeError, match=r"\('w',\), not 'w'"):
        ReshardingInfo({}, ["w"])


def test_an_unhashable_component_is_named() -> None:
    with pytest.raises(ConfigTypeError, match=r"component \['b'\] \(list\) can be no dict key"):
        CheckpointPath("k", ("a", ["b"]))


def test_a_list_path_is_its_tuple_in_every_record_that_can_hold_one() -> None:
    """Defect: `CheckpointPath` took a list path as its tuple, `ReshardingInfo` refused the same list
    (ConfigTypeError), and a resharder's `load` returning one was refused too."""
    assert CheckpointPath("k", ["a", 0]).nested_path == ("a", 0)
    info = ReshardingInfo({}, [["a", 0], (True, None, (1, "x"))])
    assert info.non_reshardable_paths == [("a", 0), (True, None, (1, "x"))]
    assert all(type(p) is tuple for p in info.non_reshardable_paths)


def test_a_resharders_unfilled_paths_are_checked_by_the_same_rule() -> None:
    """A tuple holding a list passed, and failed later in `CheckpointPath` naming no resharder."""
    from torch_checkpointing.checkpoint_loader import _checked_unfilled

    assert _checked_unfilled("Mine", "model", [["a", 0], (True,)]) == [("a", 0), (True,)]
    with pytest.raises(ConfigTypeError, match=r"Mine.load for item 'model' returned an entry that must be a nested"):
        _checked_unfilled("Mine", "model", [("a", ["b"])])
