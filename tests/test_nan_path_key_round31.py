"""A NaN dict key is refused where a checkpoint path is recorded, naming it (round 31).

metadata.json and `CheckpointPath.serialize` take any float component, and JSON writes NaN as `NaN`; but a NaN
read back is a new float unequal to every other, the one the record was made from too. A DTensor saved under a
NaN key (`{float("nan"): ...}`) was saved, and its load with the same template (the same NaN object) returned the
template's DTensor unfilled under one `nan` key and the saved values as a plain tensor under a second; the record
read back from metadata.json was unequal to the one written: the round trip both promise ("exact") did not hold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_nested_path_keys_round31 import _item
from torch_checkpointing import CheckpointManager, DTensorResharder, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.types import CheckpointPath

NAN = float("nan")


def test_a_dtensor_under_a_nan_key_is_refused_at_save_naming_the_key(mesh: Any, tmp_path: Path) -> None:
    """Defect: the save succeeded; the load into `{"m": {NAN: <zeros DTensor>}}` gave `{nan: DTensor(zeros), nan:
    tensor([0., 1., 2., 3.])}`, raising nothing."""
    from torch.distributed.tensor import Shard, distribute_tensor

    config = CheckpointManager.Config(
        items={"item": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
    )
    manager = CheckpointManager(config)
    state = {"m": {NAN: distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}}
    try:
        with pytest.raises(ConfigError, match=r"nan"):
            manager.save(str(tmp_path / "c"), {"item": state})
    finally:
        manager.close()


def test_a_nan_component_is_refused_when_the_record_is_built() -> None:
    """Defect: the record was built, and `from_dict(json.loads(to_json()))` gave one unequal to it."""
    with pytest.raises(ConfigError, match=r"has component nan"):
        _item(("m", NAN, 0))


@pytest.mark.parametrize("component", [NAN, (1, NAN)], ids=repr)
def test_checkpoint_path_serialize_refuses_a_nan_component(component: object) -> None:
    """Defect: serialize() wrote `["item","m",NaN]`, which deserialize() gave back unequal to the path."""
    path = CheckpointPath("item", ("m", component))
    with pytest.raises(ConfigError, match=r"nan"):
        json.loads(path.serialize())
