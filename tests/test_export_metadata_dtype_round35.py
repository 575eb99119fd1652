"""An export refusing sharding metadata whose dtype disagrees with the saved shard names the dtype (round 35).

metadata.json recording float64 for a tensor whose shard is saved as float32 (the manifest's checksum of it
made to match) was refused by the export as "the global_shape (4, 2) it records ... does not fit the saved
shards": the shape it blamed was right, and a reader looked for a wrong shape that is not there.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import export_hf


def _save(checkpoint: Path, mesh: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    config = CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
    )
    with CheckpointManager(config) as manager:
        w = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        manager.save(str(checkpoint), {"model": {"w": w}})


def _record_dtype(checkpoint: Path, dtype: str) -> None:
    """metadata.json records `dtype` for model::w, its size and checksum in the manifest made to match."""
    path = checkpoint / "metadata.json"
    metadata = json.loads(path.read_text())
    metadata["metadata"]["model"]["nested_path_to_metadata"]['["w"]'][0]["sharding_metadata"]["data"]["dtype"] = dtype
    data = json.dumps(metadata).encode()
    path.write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["metadata_crc32"], manifest["metadata_size"] = zlib.crc32(data), len(data)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_recorded_dtype_the_shard_lacks_is_named_as_the_dtype(tmp_path: Path, mesh: Any) -> None:
    checkpoint = tmp_path / "step_1"
    _save(checkpoint, mesh)
    _record_dtype(checkpoint, "torch.float64")
    with pytest.raises(CorruptCheckpointError, match="metadata.json") as refused:
        export_hf(str(checkpoint), "model", str(tmp_path / "hf"))
    said = str(refused.value)
    assert "global_shape" not in said, said
    assert "torch.float64" in said and "torch.float32" in said and "model::w" in said, said
    assert not (tmp_path / "hf").exists()
