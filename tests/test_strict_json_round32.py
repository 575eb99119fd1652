"""Every JSON file a save writes is strict JSON (round 32).

metadata.json recorded a DTensor's path under an infinite dict key as the bare token `Infinity`: Python's reader
gives it back, but `jq`, JavaScript's `JSON.parse` and every other strict parser refuse the whole file. Such a
key is refused at save, like NaN, naming the item, the dict and the fix; files an older engine wrote with it
still load. JSON items are the user's data and keep their documented NaN/Infinity tokens (docs/guide.md).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

from torch_checkpointing import CheckpointManager, DTensorResharder, ItemSpec, list_checkpoints
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    SafetensorsSerialization,
    TorchSerialization,
)
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import DistributedMetadata, nested_path_from_json
from torch_checkpointing.errors import ConfigError


def _no_constant(token: str) -> NoReturn:
    raise ValueError(f"non-standard JSON token {token}")


def _strict(text: str) -> Any:
    """Parse as a strict JSON parser (jq, JSON.parse) does: no NaN/Infinity tokens."""
    return json.loads(text, parse_constant=_no_constant)


def _json_files(root: Path) -> dict[str, str]:
    """Every file under `root` whose text is JSON to Python's lenient reader, by relative path."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            try:
                text = path.read_bytes().decode("utf-8")
                json.loads(text)
            except ValueError:
                continue
            found[os.path.relpath(path, root)] = text
    return found


def _config(saver: Any) -> CheckpointManager.Config:
    return CheckpointManager.Config(
        items={
            "dt": ItemSpec(resharder=DTensorResharder()),
            "st": ItemSpec(layout=LayoutInfo("st_{rank}.safetensors", SafetensorsSerialization()), required=False),
            "js": ItemSpec(layout=LayoutInfo("js_{rank}.json", JsonSerialization()), required=False),
            "pt": ItemSpec(layout=LayoutInfo("pt_{rank}.pt", TorchSerialization()), required=False),
        },
        save=saver,
    )


@pytest.mark.parametrize("saver", [SyncCheckpointSaverConfig, AsyncCheckpointSaverConfig], ids=["sync", "async"])
def test_every_json_file_a_save_writes_is_strict(mesh: Any, tmp_path: Path, saver: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    state = {
        "dt": {"m": {1.5: distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]), "w": torch.ones(2)}},
        "st": {"w": torch.ones(3)},
        "js": {"step": 3, "lr": 0.1},
        "pt": {"w": torch.ones(2), math.inf: 1},  # pickled: any key
    }
    with CheckpointManager(_config(saver())) as manager:
        done = manager.save(str(tmp_path / "ck"), state, metrics={"loss": math.nan, "acc": -math.inf})
        if done is not None:
            done.result()
    files = _json_files(tmp_path / "ck")
    assert {"manifest.json", "metadata.json", "js_0.json"} <= set(files), sorted(files)
    for name, text in files.items():
        try:
            _strict(text)
        except ValueError as exc:
            pytest.fail(f"{name} is not strict JSON: {exc}")


@pytest.mark.parametrize("key", [math.inf, -math.inf, (1, math.inf)], ids=["inf", "-inf", "inf-in-a-tuple-key"])
@pytest.mark.parametrize("saver", [SyncCheckpointSaverConfig, AsyncCheckpointSaverConfig], ids=["sync", "async"])
def test_a_dtensor_under_an_infinite_key_is_refused_naming_it(mesh: Any, tmp_path: Path, key: Any, saver: Any) -> None:
    """Defect: the save committed a metadata.json holding `Infinity`, which strict parsers refuse."""
    from torch.distributed.tensor import Shard, distribute_tensor

    state = {"dt": {"m": {key: distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}}}
    with CheckpointManager(_config(saver())) as manager:
        with pytest.raises(ConfigError, match=r"item 'dt'.*dt::m.*inf.*strict JSON.*Rename the key"):
            done = manager.save(str(tmp_path / "ck"), state)
            if done is not None:
                done.result()
        ok = manager.save(str(tmp_path / "ok"), {"dt": {"m": {"inf": torch.ones(1)}}})
        if ok is not None:
            ok.result()
    assert [info.path for info in list_checkpoints(tmp_path)] == [str(tmp_path / "ok")]


def test_a_metadata_file_an_older_engine_wrote_with_infinity_still_reads() -> None:
    """What round 31 wrote for an infinite key (the bare token) is still read back: refusing it at save must not
    strand checkpoints already on disk."""
    assert nested_path_from_json('["m",Infinity,[1,-Infinity]]') == ("m", math.inf, (1, -math.inf))
    text = (
        '{"metadata": {"dt": {"nested_path_to_metadata": {"[\\"m\\",Infinity,0]": [{"ranks": [0], '
        '"sharding_metadata": {"data": {"dtype": "torch.float32", "global_shape": [2], "mesh_spec": {"device_type": '
        '"cpu", "mesh_data": [0], "mesh_dim_names": null, "mesh_shape": [1]}, "placements": [{"type": "Replicate"}], '
        '"stride": [1]}, "type": "DTensorShardingMetadata"}}]}, "rank_to_layout_info": {"0": null}}}, "version": '
        '"3.1", "world_size": 1}'
    )  # DistributedMetadata.to_json() of round 31 for the path ("m", inf, 0)
    record = DistributedMetadata.from_json(text)
    assert ("m", math.inf, 0) in record.metadata["dt"].nested_path_to_metadata
