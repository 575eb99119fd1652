"""A DTensor under any dict key a checkpoint path can name saves and loads (round 31).

Round 30 (7364bdf) let a nested path hold any dict key: `CheckpointPath` and the resharding records took bools,
floats, None and tuples, and `CheckpointPath.serialize` writes them. `DistributedItemMetadata` took them too, but
its `to_dict` (metadata.json) refused every component but str and int, so the save of a DTensor under such a key
failed late, at the metadata write. Now a nested path in metadata.json is written and read by the rule
`CheckpointPath.serialize` keeps (str, int, float, bool, None and tuples of them), and a component with no JSON
form (a frozenset, bytes) is refused when the record is built, with the message the save gave.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, DTensorResharder, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import (
    DistributedItemMetadata,
    DistributedMetadata,
    GlobalObjectMetadata,
    nested_path_from_json,
    nested_path_to_json,
)
from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata
from torch_checkpointing.errors import ConfigError

KEYS = [True, 1.5, None, (1, "a"), ("x", (2, None))]


def _item(path: tuple[Any, ...]) -> DistributedItemMetadata:
    group = GlobalObjectMetadata(DTensorShardingMetadata.replicated(torch.zeros(2), 1), (0,))
    return DistributedItemMetadata({path: [group]}, {0: None})


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_a_dtensor_under_any_dict_key_saves_and_loads(mesh: Any, tmp_path: Path, key: object) -> None:
    """Defect: the save raised ConfigError "Nested path ('m', True) has component True of type bool; only str
    dict keys and int indices can be recorded in sharding metadata" (after the record took the path)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    config = CheckpointManager.Config(
        items={"item": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
    )
    manager = CheckpointManager(config)
    try:
        manager.save(
            str(tmp_path / "c"), {"item": {"m": {key: distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}}}
        )
        template = {"m": {key: distribute_tensor(torch.zeros(4), mesh, [Replicate()])}}
        got = manager.load(str(tmp_path / "c"), into={"item": template})["item"]
    finally:
        manager.close()
    assert got["m"][key].to_local().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_metadata_json_gives_back_the_path(key: object) -> None:
    path = ("m", key, 0)
    assert nested_path_from_json(nested_path_to_json(path)) == path
    record = DistributedMetadata({"item": _item(path)}, 1)
    assert DistributedMetadata.from_dict(json.loads(record.to_json())) == record


@pytest.mark.parametrize("key", [frozenset({1}), b"w", ("a", frozenset())], ids=repr)
def test_a_key_json_cannot_give_back_is_refused_when_the_record_is_built(key: object) -> None:
    """The refusal comes at construction, naming the component, with the words the save used to give."""
    with pytest.raises(ConfigError, match=r"Nested path .* has component .*can be recorded in sharding metadata"):
        _item(("m", key))
