"""`CheckpointInfo` and `CheckpointPath` refuse a field of the wrong type naming it (round 29).

Both took anything: a `CheckpointInfo` built by hand (a test double, a listing of one's own) with `path=None`
failed in `name` with a bare AttributeError, `items=None` in `to_dict()` with a bare TypeError; a
`CheckpointPath` with a list path did not hash (it is frozen to be a dict key), one with a bool or float component
serialized to JSON its own `deserialize()` refuses, and an int item key failed in `str()`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.discovery import CheckpointInfo
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.types import CheckpointPath

_INFO: dict[str, Any] = {
    "path": "/ck/step_1",
    "step": 1,
    "commit_time": 1.5,
    "world_size": 1,
    "total_bytes": 10,
    "metrics": None,
    "library_version": "1.0",
    "items": ("model",),
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("path", None),
        ("path", b"/ck"),
        ("step", "1"),
        ("step", True),
        ("commit_time", "now"),
        ("world_size", None),
        ("total_bytes", 1.5),
        ("metrics", [1]),
        ("library_version", 1),
        ("items", None),
        ("items", ("model", 1)),
    ],
)
def test_checkpoint_info_refuses_a_field_of_the_wrong_type_naming_it(field: str, value: Any) -> None:
    """Defect: each was accepted; `path=None` then failed in `name` ("'NoneType' object has no attribute
    'rstrip'"), `items=None` in `to_dict()` ("'NoneType' object is not iterable")."""
    with pytest.raises(ConfigTypeError, match=f"CheckpointInfo.{field} must"):
        CheckpointInfo(**{**_INFO, field: value})


def test_checkpoint_info_takes_what_it_is() -> None:
    info = CheckpointInfo(**{**_INFO, "items": ["model"], "commit_time": 2, "step": None, "metrics": {"loss": 1.0}})
    assert info.items == ("model",) and info.name == "step_1" and info.to_dict()["items"] == ["model"]
    listed = CheckpointInfo(**{**_INFO, "items": ["model"]})
    assert listed == CheckpointInfo(**_INFO) and hash(listed) == hash(CheckpointInfo(**_INFO))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ((5,), "item_key"),
        ((None, ()), "item_key"),
        (("k", "ab"), "nested_path"),
        (("k", ("a", ["b"])), "nested_path"),
        (("k", None), "nested_path"),
    ],
)
def test_checkpoint_path_refuses_a_field_of_the_wrong_type_naming_it(args: tuple, named: str) -> None:
    """Defect: ("k", "ab") was the path ("a", "b"); ("k", ("a", ["b"])) did not hash; (5,) raised "TypeError:
    __str__ returned non-string" only when printed."""
    with pytest.raises(ConfigTypeError, match=f"CheckpointPath.{named} must"):
        CheckpointPath(*args)


def test_a_checkpoint_path_given_a_list_is_the_one_given_the_tuple() -> None:
    """Defect: "TypeError: unhashable type: 'list'" (it is a dict key of missing and unexpected paths)."""
    listed = CheckpointPath("k", ["a", 0])  # type: ignore[arg-type]
    assert listed == CheckpointPath("k", ("a", 0)) and {listed: 1}[CheckpointPath("k", ("a", 0))] == 1
    assert CheckpointPath.deserialize(listed.serialize()) == listed


@pytest.mark.parametrize("key", [True, 1.5, None, (1, "a"), ("x", (2, None))], ids=repr)
def test_a_value_whose_dict_keys_are_not_str_saves_and_loads(tmp_path: Path, key: object) -> None:
    """A dict key the engine walks names a location: refusing every component but str and int (this round's first
    check) refused every save of such a value: "ConfigTypeError: CheckpointPath.nested_path must be a tuple of str
    keys and int indices ..., got tuple (True,)" (the value fidelity harness found it with tuple keys)."""
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(str(tmp_path / "c"), {"m": {key: torch.ones(2)}})
        got = manager.load(str(tmp_path / "c"), {"m": {key: torch.zeros(2)}})
    assert got["m"][key].tolist() == [1.0, 1.0]
