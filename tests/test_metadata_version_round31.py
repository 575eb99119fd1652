"""metadata.json holding a path component an earlier engine refuses is marked with a version that engine calls newer.

Round 31 let metadata.json record dict keys that are bool, float, None or tuples (see
test_nested_path_keys_round31). An engine of round 30 reads sharding metadata version "3.0" and refuses such a
component as a malformed file: its `ls` and `verify` would call a healthy checkpoint DAMAGED, the state an operator
deletes. A file that holds one is now written as version "3.1", which that engine refuses as a newer engine's
(`NewerCheckpointError`: "it is not damaged; do not delete it"); every other file stays "3.0", readable by both.
"""

from __future__ import annotations

import enum
import json
from typing import Any

import pytest
import torch

from torch_checkpointing import distributed_metadata
from torch_checkpointing.distributed_metadata import (
    DistributedItemMetadata,
    DistributedMetadata,
    GlobalObjectMetadata,
)
from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata
from torch_checkpointing.errors import NewerCheckpointError


def _record(key: object) -> DistributedMetadata:
    group = GlobalObjectMetadata(DTensorShardingMetadata.replicated(torch.zeros(2), 1), (0,))
    return DistributedMetadata({"item": DistributedItemMetadata({("m", key, 0): [group]}, {0: None})}, 1)


@pytest.mark.parametrize(
    ("key", "version"),
    [("w", "3.0"), (7, "3.0"), (True, "3.1"), (1.5, "3.1"), (None, "3.1"), (("a", 1), "3.1"), (("a", None), "3.1")],
    ids=repr,
)
def test_the_version_says_whether_an_earlier_engine_reads_the_paths(key: object, version: str) -> None:
    """Defect: every file said "3.0", and round 30's engine refused the bool/float/None/tuple ones as damaged."""
    record = _record(key)
    written: dict[str, Any] = json.loads(record.to_json())
    assert written["version"] == version
    assert DistributedMetadata.from_dict(written) == record  # this engine reads both back equal


def test_an_engine_reading_up_to_3_0_calls_a_3_1_file_newer(monkeypatch: pytest.MonkeyPatch) -> None:
    written = json.loads(_record(True).to_json())
    monkeypatch.setattr(distributed_metadata, "READABLE_METADATA_VERSIONS", ("2.0", "3.0"))
    with pytest.raises(NewerCheckpointError, match="not damaged"):
        DistributedMetadata.from_dict(written)


class _Kind(enum.IntEnum):
    FIRST = 1


class _Name(str):
    pass


@pytest.mark.parametrize("key", [_Kind.FIRST, _Name("w")], ids=["IntEnum", "str-subclass"])
def test_an_int_or_str_subclass_key_stays_version_3_0(key: object) -> None:
    """Defect: '3.1' (an IntEnum key or a str subclass is no exact int or str), though the file holds the same
    plain JSON int or string as one of an int or str key: round 30's engine refused it as a newer engine's."""
    written: dict[str, Any] = json.loads(_record(key).to_json())
    assert written["version"] == "3.0"
    assert written == json.loads(_record(int(key) if isinstance(key, int) else str(key)).to_json())
