"""Every sharding record takes any integer where it holds an int, and stores the plain int (round 31).

Round 30 made `LoadPlan` and `get_file_path` take numpy's integers by converting them at each call site; the
sharding records (`ShardSpec`, `DeviceMeshSpec`, `DTensorShardingMetadata`, `GlobalObjectMetadata`,
`DistributedItemMetadata`, `DistributedMetadata`) still refused them, so a sharding computed with numpy failed
at save. The conversion is now the field check's own, so every record gets it; a bool is still refused.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.distributed_metadata import (
    DistributedItemMetadata,
    DistributedMetadata,
    GlobalObjectMetadata,
    ShardingMetadata,
)
from torch_checkpointing.dtensor_metadata import (
    DeviceMeshSpec,
    DTensorShardingMetadata,
    ShardSpec,
    StridedShardSpec,
)
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.resharding import LoadPlan


class _Two(enum.IntEnum):
    TWO = 2


class _Index:
    """An integer that is no int: what `operator.index` takes."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n


def _mesh(i: Callable[[int], Any]) -> DeviceMeshSpec:
    return DeviceMeshSpec("cpu", (i(2),), (i(0), i(1)))


def _dtensor(i: Callable[[int], Any]) -> DTensorShardingMetadata:
    return DTensorShardingMetadata((i(4), i(2)), "torch.float32", (i(2), i(1)), _mesh(i), (ShardSpec(i(0)),))


def _group(i: Callable[[int], Any]) -> GlobalObjectMetadata:
    return GlobalObjectMetadata(_dtensor(i), (i(0), i(1)))


def _item(i: Callable[[int], Any]) -> DistributedItemMetadata:
    layout = LayoutInfo("w_{rank}.pt", TorchSerialization())
    return DistributedItemMetadata({("w",): [_group(i)]}, {i(0): layout, i(1): None})


def _distributed(i: Callable[[int], Any]) -> DistributedMetadata:
    return DistributedMetadata({"w": _item(i)}, i(2))


def _plan(i: Callable[[int], Any]) -> LoadPlan:
    return LoadPlan((i(0),), (i(2),), i(1), "w", (i(0),), (i(2),), src_elem_size=i(4))


# Every public record with an int field, built from `i(n)` for each int n, and how it is read back from JSON.
RECORDS: dict[str, tuple[Callable[[Callable[[int], Any]], Any], Callable[[Any], Any]]] = {
    "ShardSpec": (lambda i: ShardSpec(i(1)), ShardSpec.from_dict),
    "StridedShardSpec": (lambda i: StridedShardSpec(i(0), i(2)), StridedShardSpec.from_dict),
    "DeviceMeshSpec": (_mesh, DeviceMeshSpec.from_dict),
    "DTensorShardingMetadata": (_dtensor, DTensorShardingMetadata.from_dict),
    "DTensorShardingMetadata.replicated": (
        lambda i: DTensorShardingMetadata.replicated(torch.zeros(2), i(2)),
        DTensorShardingMetadata.from_dict,
    ),
    "GlobalObjectMetadata": (_group, GlobalObjectMetadata.from_dict),
    "DistributedItemMetadata": (_item, DistributedItemMetadata.from_dict),
    "DistributedMetadata": (_distributed, DistributedMetadata.from_dict),
    "LoadPlan": (_plan, None),  # no JSON form: a plan lives in one load
}

INTEGERS: dict[str, Callable[[int], Any]] = {
    "int64": np.int64,
    "int32": np.int32,
    "uint8": np.uint8,
    "IntEnum": lambda n: _Two.TWO if n == 2 else n,
    "__index__": _Index,
}


def _ints_only(value: Any, where: str = "") -> None:
    """Every number reachable from `value`'s fields (a dataclass's, a dict's keys and values) is a plain int."""
    if isinstance(value, (bool, str, type(None), torch.dtype)):
        return
    if isinstance(value, (int, float)) or hasattr(type(value), "__index__"):
        assert type(value) is int, f"{where} holds {type(value).__name__} {value!r}"
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _ints_only(k, f"{where}[key {k!r}]")
            _ints_only(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for n, v in enumerate(value):
            _ints_only(v, f"{where}[{n}]")
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            _ints_only(getattr(value, name), f"{where}.{name}")


def _json(record: Any) -> str:
    if isinstance(record, DistributedMetadata):
        return record.to_json()
    return json.dumps(record.to_dict())


@pytest.mark.parametrize("kind", list(INTEGERS))
@pytest.mark.parametrize("name", list(RECORDS))
def test_a_record_built_of_integers_is_the_record_of_ints(name: str, kind: str) -> None:
    """Defect: every record but LoadPlan raised ConfigTypeError, e.g. "ShardSpec.dim must be an int, got int64
    np.int64(1)", "DeviceMeshSpec.mesh_shape must hold ints only, got int64 np.int64(2)"."""
    build, read = RECORDS[name]
    record = build(INTEGERS[kind])
    _ints_only(record, name)
    assert record == build(int)
    if read is not None:  # what a save writes is JSON of plain ints, and reads back as the same record
        text = _json(record)
        assert text == _json(build(int))
        assert read(json.loads(text)) == record


@pytest.mark.parametrize("name", [n for n in RECORDS if n != "LoadPlan"])
def test_a_bool_is_still_no_integer(name: str) -> None:
    build, _ = RECORDS[name]
    with pytest.raises(ConfigTypeError, match="bool|int"):
        build(lambda n: bool(n) if n > 0 else n)


def test_the_tree_of_numpy_records_saves_as_plain_ints() -> None:
    """The whole metadata.json of a numpy-built sharding is the one of ints, and reads back equal."""
    record = _distributed(np.int64)
    parsed = DistributedMetadata.from_dict(json.loads(record.to_json()))
    assert parsed == _distributed(int)
    assert isinstance(parsed.metadata["w"].nested_path_to_metadata[("w",)][0].sharding_metadata, ShardingMetadata)


def test_get_layout_takes_a_numpy_rank() -> None:
    assert _item(np.int64).get_layout(np.int64(0), "w").file_path == "w_{rank}.pt"


@pytest.mark.parametrize("kind", list(INTEGERS))
def test_compute_local_shard_info_takes_an_integer_rank(kind: str) -> None:
    """Defect: ConfigTypeError "compute_local_shard_info/compute_local_runs: rank must be an int, got
    np.int64(1)"."""
    from torch_checkpointing.dtensor_resharder import compute_local_shard_info

    metadata = _dtensor(int)
    assert compute_local_shard_info(metadata, INTEGERS[kind](1)) == ((2, 2), (2, 0))
