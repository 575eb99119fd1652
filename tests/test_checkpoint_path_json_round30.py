"""`CheckpointPath.serialize()` and `deserialize()`: every path one writes, the other reads back as it was."""

from __future__ import annotations

from typing import Any

import pytest

from torch_checkpointing.errors import ConfigError
from torch_checkpointing.types import CheckpointPath


@pytest.mark.parametrize("component", [True, False, 1.5, None, (1, "a"), ("x", (2, None)), "s", 0, -3])
def test_serialize_is_read_back_by_deserialize(component: Any) -> None:
    """Defect: a path component may be any dict key, and `serialize()` wrote True, 1.5, None and tuples as JSON
    that `deserialize()` refused: "ConfigError: Cannot deserialize CheckpointPath from '["k","a",true]'"."""
    path = CheckpointPath("k", ("a", component))
    back = CheckpointPath.deserialize(path.serialize())
    assert back == path and [type(c) for c in back.nested_path] == [type(c) for c in path.nested_path]


@pytest.mark.parametrize("component", [frozenset([1]), ("a", frozenset()), b"raw"])
def test_serialize_refuses_a_component_json_cannot_carry_naming_it(component: Any) -> None:
    """Such a key is a valid location, but JSON cannot give it back: said, naming it, not a bare TypeError."""
    with pytest.raises(ConfigError, match=r"CheckpointPath.serialize.*component.*str\(\)"):
        CheckpointPath("k", ("a", component)).serialize()


@pytest.mark.parametrize("text", ['["k",{"a":1}]', '["k",[1,[2,{}]]]'])
def test_deserialize_still_refuses_what_serialize_never_writes(text: str) -> None:
    with pytest.raises(ConfigError, match="Cannot deserialize CheckpointPath"):
        CheckpointPath.deserialize(text)
