"""`max_shard_size` (`--max-shard-size`) read exactly (round 34).

The number was read through a float: a byte count past 2**53 came back another count
(`9007199254740993` -> `9007199254740992`), and one past a float's range (400 digits) raised a bare
`OverflowError: cannot convert float infinity to integer`, naming neither the argument nor the fix.
"""

from __future__ import annotations

import pytest

from torch_checkpointing.errors import ConfigError
from torch_checkpointing.hf import parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("9007199254740993", 9007199254740993),
        ("9007199254740993B", 9007199254740993),
        ("1.000000000000000001GB", 1000000000),
        ("0.1KB", 100),
        ("2.5GiB", 5 * 1024**3 // 2),
        ("9" * 400, int("9" * 400)),
    ],
)
def test_a_size_is_read_exactly(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_a_size_of_too_many_digits_is_a_config_error_naming_the_argument() -> None:
    with pytest.raises(ConfigError, match=r"max_shard_size"):
        parse_size("9" * 5000)
