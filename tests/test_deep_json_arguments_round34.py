"""A JSON argument nested deeper than Python's parser recurses gets the ConfigError any other bad one gets.

`CheckpointPath.deserialize`, `nested_path_from_json` and `DistributedMetadata.from_json` caught what
`json.loads` raises for text that is no JSON, but not the RecursionError it raises for `[[[[...` a few
thousand levels deep, nor the one their recursive component checks raised for a list 900 deep that did parse:
a bare RecursionError, naming neither the argument nor what it should be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from torch_checkpointing.distributed_metadata import DistributedMetadata, nested_path_from_json
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.types import CheckpointPath

_DEEP = "[" * 20_000 + "]" * 20_000  # past the parser's recursion
_PARSED = "[" * 900 + "]" * 900  # within it, past the component checks' (each level a call deeper)


@pytest.mark.parametrize(
    "parse",
    [CheckpointPath.deserialize, nested_path_from_json, DistributedMetadata.from_json],
    ids=["CheckpointPath.deserialize", "nested_path_from_json", "DistributedMetadata.from_json"],
)
@pytest.mark.parametrize(
    "text",
    [_DEEP, f'["model", {_DEEP}]', f'{{"items": {_DEEP}}}', f'["model", {_PARSED}]'],
    ids=["bare", "in-list", "in-object", "parsed-in-list"],
)
def test_a_deeply_nested_argument_is_a_config_error(parse: Callable[[str], Any], text: str) -> None:
    with pytest.raises(ConfigError):
        parse(text)
