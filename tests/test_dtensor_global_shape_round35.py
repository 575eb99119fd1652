"""A metadata.json whose global_shape its own saved shards do not fit is damage, not a changed model (round 35).

global_shape edited from [4, 2] to [6, 2] over a saved (4, 2) shard (the manifest's metadata checksum made to
match): a load into the model that was saved, a (4, 2) template, raised TemplateMismatchError "The model changed
since the save", and one into a (6, 2) DTensor template "checkpoint holds (4, 2), template has (6, 2)". The
plain-template load and the export called the same thing damage. The saved shards are now checked against the
global shape the metadata records before the template is compared with it.
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
from torch_checkpointing.errors import CorruptCheckpointError, TemplateMismatchError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _config() -> CheckpointManager.Config:
    return CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
    )


def _save(checkpoint: Path, mesh: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    with CheckpointManager(_config()) as manager:
        w = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        manager.save(str(checkpoint), {"model": {"w": w}})


def _record_global_shape(checkpoint: Path, shape: list[int]) -> None:
    """metadata.json records `shape` for model::w, its size and checksum in the manifest made to match."""
    path = checkpoint / "metadata.json"
    metadata = json.loads(path.read_text())
    group = metadata["metadata"]["model"]["nested_path_to_metadata"]['["w"]'][0]
    group["sharding_metadata"]["data"]["global_shape"] = shape
    data = json.dumps(metadata).encode()
    path.write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["metadata_crc32"], manifest["metadata_size"] = zlib.crc32(data), len(data)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _template(mesh: Any, shape: tuple[int, int], dtensor: bool) -> Any:
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(torch.zeros(shape), mesh, [Shard(0)]) if dtensor else torch.zeros(shape)


@pytest.mark.parametrize("shape", [(4, 2), (6, 2)])
@pytest.mark.parametrize("dtensor", [True, False], ids=["dtensor", "plain"])
def test_a_global_shape_the_shards_do_not_fit_is_damage(
    tmp_path: Path, mesh: Any, shape: tuple[int, int], dtensor: bool
) -> None:
    checkpoint = tmp_path / "step_1"
    _save(checkpoint, mesh)
    _record_global_shape(checkpoint, [6, 2])
    target = _template(mesh, shape, dtensor)
    with CheckpointManager(_config()) as manager, pytest.raises(CorruptCheckpointError) as refused:
        manager.load(str(checkpoint), {"model": {"w": target}})
    said = str(refused.value)
    assert not isinstance(refused.value, TemplateMismatchError), said
    assert "metadata" in said and "model" in said and "(6, 2)" in said and "(4, 2)" in said, said
    assert "model changed" not in said, said
    assert not torch.count_nonzero(target.to_local() if dtensor else target), "nothing is loaded"


def test_a_changed_model_is_still_named_so(tmp_path: Path, mesh: Any) -> None:
    """Intact metadata and a template of another shape: the template is blamed, as before."""
    checkpoint = tmp_path / "step_1"
    _save(checkpoint, mesh)
    with CheckpointManager(_config()) as manager, pytest.raises(TemplateMismatchError, match="model changed"):
        manager.load(str(checkpoint), {"model": {"w": _template(mesh, (6, 2), True)}})


def _record_dtype(checkpoint: Path, dtype: str) -> None:
    path = checkpoint / "metadata.json"
    metadata = json.loads(path.read_text())
    group = metadata["metadata"]["model"]["nested_path_to_metadata"]['["w"]'][0]
    group["sharding_metadata"]["data"]["dtype"] = dtype
    data = json.dumps(metadata).encode()
    path.write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["metadata_crc32"], manifest["metadata_size"] = zlib.crc32(data), len(data)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_recorded_dtype_the_shard_lacks_is_damage_in_a_direct_read(tmp_path: Path, mesh: Any) -> None:
    """A DTensor template built to the recorded (float64) layout is read directly: the float32 shard is damage,
    not a "Dtype mismatch" blaming the template."""
    from torch.distributed.tensor import Shard, distribute_tensor

    checkpoint = tmp_path / "step_1"
    _save(checkpoint, mesh)
    _record_dtype(checkpoint, "torch.float64")
    target = distribute_tensor(torch.zeros(4, 2, dtype=torch.float64), mesh, [Shard(0)])
    with CheckpointManager(_config()) as manager, pytest.raises(CorruptCheckpointError) as refused:
        manager.load(str(checkpoint), {"model": {"w": target}})
    said = str(refused.value)
    assert not isinstance(refused.value, TemplateMismatchError), said
    assert "metadata.json" in said and "torch.float64" in said and "torch.float32" in said, said


@pytest.mark.parametrize("recorded, target, error", [(12, 8, CorruptCheckpointError), (8, 12, TemplateMismatchError)])
def test_two_source_ranks_judged_by_their_shards(tmp_path: Path, recorded: int, target: int, error: type) -> None:
    """Two ranks saved [0, 4) and [4, 8) of a Shard(0) tensor. Metadata recording 12 elements (6 a rank) over a
    target of the 8 saved is damage naming metadata.json; intact metadata (8) and a target of 12 a changed model."""
    from tests.test_reshard_plans import ITEM, local_storage, make_md
    from torch_checkpointing.distributed_metadata import DistributedItemMetadata, GlobalObjectMetadata
    from torch_checkpointing.dtensor_metadata import ReplicateSpec, ShardSpec

    for rank, part in enumerate(torch.arange(8.0).split(4)):
        torch.save({"w": part.clone()}, tmp_path / f"{ITEM}_{rank}.pt")
    saved = make_md((recorded,), torch.float32, ((2,), (0, 1), (ShardSpec(0),)))
    source = DistributedItemMetadata({("w",): [GlobalObjectMetadata(saved, (0, 1))]}, dict.fromkeys(range(2)))
    into = torch.full((target,), -1.0)
    dst = make_md((target,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    with pytest.raises(error) as refused:
        DTensorResharder().load_as_rank(0, tmp_path, ITEM, {("w",): dst}, source, {"w": into}, local_storage())
    said = str(refused.value)
    if error is CorruptCheckpointError:
        assert "metadata.json" in said and "(6,)" in said and "(4,)" in said and "model changed" not in said, said
    else:
        assert "model changed" in said, said
    assert torch.equal(into, torch.full((target,), -1.0))
