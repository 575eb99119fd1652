"""DTensor sharding metadata: placement specs, mesh specs, JSON form, and capture from live DTensors."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tests.probes import gloo_world1
from torch_checkpointing.distributed_metadata import GlobalObjectMetadata
from torch_checkpointing.dtensor_metadata import (
    DeviceMeshSpec,
    DTensorShardingMetadata,
    ReplicateSpec,
    ShardSpec,
    StridedShardSpec,
    get_device_mesh_spec,
    placement_spec_from_dict,
)
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import CorruptCheckpointError, NewerCheckpointError


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A world-1 gloo group over a FileStore: real DTensors without any network port."""
    if dist.is_initialized():
        yield
        return
    with gloo_world1(dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)):
        yield


def test_placement_specs_round_trip_and_print() -> None:
    for spec in (ShardSpec(1), ReplicateSpec(), StridedShardSpec(0, 4)):
        assert placement_spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert ShardSpec(2).to_dict() == {"type": "Shard", "dim": 2}
    assert ReplicateSpec().to_dict() == {"type": "Replicate"}
    assert StridedShardSpec(0, 4).to_dict() == {"type": "StridedShard", "dim": 0, "split_factor": 4}
    assert str(ShardSpec(2)) == "Shard(2)" and repr(ShardSpec(2)) == "ShardSpec(dim=2)"
    assert str(ReplicateSpec()) == "Replicate" and ReplicateSpec() == ReplicateSpec()
    assert ShardSpec(0) != StridedShardSpec(0, 1)


def test_unknown_placement_type_is_refused() -> None:
    with pytest.raises(NewerCheckpointError, match="placement type 'Partial', which this engine does not know"):
        placement_spec_from_dict({"type": "Partial"})
    with pytest.raises(CorruptCheckpointError, match="placement type 3, which no engine writes"):
        placement_spec_from_dict({"type": 3})


def test_device_mesh_spec_coordinates_and_interning() -> None:
    spec = get_device_mesh_spec("cpu", (2, 2), (0, 2, 1, 3), ("dp", "tp"))
    assert spec.get_coordinate(2) == (0, 1)
    assert spec.get_coordinate(1) == (1, 0)
    assert spec.get_coordinate(9) is None
    assert torch.equal(spec.mesh, torch.tensor([[0, 2], [1, 3]]))
    assert get_device_mesh_spec("cpu", (2, 2), (0, 2, 1, 3), ("dp", "tp")) is spec
    assert DeviceMeshSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) is spec
    assert DeviceMeshSpec.from_mesh("cpu", torch.tensor([[0, 2], [1, 3]]), ("dp", "tp")) is spec
    with pytest.raises(ValueError, match="mesh_shape"):
        DeviceMeshSpec("cpu", (2, 2), (0, 1, 2))


def _md(placements: tuple = (ShardSpec(0),)) -> DTensorShardingMetadata:
    mesh = get_device_mesh_spec("cpu", (4,), (0, 1, 2, 3), None)
    return DTensorShardingMetadata((8, 3), "torch.bfloat16", (3, 1), mesh, placements)


def test_metadata_json_round_trip_and_equality() -> None:
    md = _md((StridedShardSpec(0, 2),))
    as_json = json.loads(json.dumps(GlobalObjectMetadata(md, (0,)).to_dict()))
    assert as_json["sharding_metadata"]["type"] == "DTensorShardingMetadata"
    back = GlobalObjectMetadata.from_dict(as_json).sharding_metadata
    assert back == md and hash(back) == hash(md)
    assert pickle.loads(pickle.dumps(md)) == md
    assert md.to_dict()["placements"] == [{"type": "StridedShard", "dim": 0, "split_factor": 2}]
    assert md.equivalent_ranks == (0, 1, 2, 3)
    assert md.torch_dtype is torch.bfloat16
    assert _md() != md


def test_metadata_validates_placements() -> None:
    mesh = get_device_mesh_spec("cpu", (4,), (0, 1, 2, 3), None)
    with pytest.raises(ValueError, match="2 placements for a 1-D mesh"):
        DTensorShardingMetadata((8,), "torch.float32", (1,), mesh, (ShardSpec(0), ShardSpec(0)))
    with pytest.raises(ValueError, match="shards dim 1 of a 1-D tensor"):
        DTensorShardingMetadata((8,), "torch.float32", (1,), mesh, (ShardSpec(1),))


def test_from_dtensor_shard_replicate_and_strided(one_rank_group: None) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    local = torch.arange(12.0).reshape(4, 3).to(torch.bfloat16)
    dt = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2), Shard(1)])
    md = DTensorShardingMetadata.from_dtensor(dt)
    assert md.placements == (StridedShardSpec(0, 2), ShardSpec(1))
    assert md.global_shape == (4, 3) and md.dtype == "torch.bfloat16"
    assert md.mesh_spec == get_device_mesh_spec("cpu", (1, 1), (0,), ("dp", "tp"))
    rep = DTensorShardingMetadata.from_dtensor(DTensor.from_local(local, mesh, [Replicate(), Replicate()]))
    assert rep.placements == (ReplicateSpec(), ReplicateSpec())


def test_partial_dtensor_is_refused_with_its_path(one_rank_group: None) -> None:
    mesh = init_device_mesh("cpu", (1,))
    dt = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    with pytest.raises(RuntimeError, match=r"Partial.*model::layer\.w.*redistribute"):
        DTensorResharder().extract_sharding_metadata("model", {"layer": {"w": dt}})


def test_extract_records_dtensors_without_warning(one_rank_group: None, recwarn: pytest.WarningsRecorder) -> None:
    mesh = init_device_mesh("cpu", (1,))
    dt = DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0)])
    md = DTensorResharder().extract_sharding_metadata("model", {"w": dt, "n": 3})
    assert list(md) == [("w",)]
    assert md[("w",)] == DTensorShardingMetadata.from_dtensor(dt)
    assert not [w for w in recwarn if "plain" in str(w.message)]


def test_metadata_json_names_placements_by_type() -> None:
    text = json.dumps(GlobalObjectMetadata(_md(), (0,)).to_dict())
    assert "torch.bfloat16" in text and "ShardSpec" not in text


def test_unpickled_mesh_is_the_interned_one_without_its_tables() -> None:
    # Gathered per-rank metadata (all_gather_object) must share mesh objects, so grouping it compares identities.
    spec = get_device_mesh_spec("cpu", (2, 2), (0, 2, 1, 3), ("dp", "tp"))
    assert spec.get_coordinate(2) == (0, 1)
    copy = pickle.loads(pickle.dumps(spec))
    assert copy is spec
    fresh = pickle.loads(pickle.dumps(DeviceMeshSpec("cpu", (3,), (0, 1, 2))))
    assert fresh is get_device_mesh_spec("cpu", (3,), (0, 1, 2))
    assert b"_derived_tables" not in pickle.dumps(spec)


def test_from_dict_reads_the_documented_in_process_forms_with_tuples() -> None:
    """API_SURFACE §5.4: `DeviceMeshSpec.to_dict()` is the dataclass dict with its tuples kept, and §9.3 shows the
    metadata as `"mesh_shape": (1,), "mesh_data": (0,), "mesh_dim_names": ("dp",)` and `"ranks": (0,)`;
    `from_dict` rebuilds from that form. It refused every tuple ("must be a list of ints, got tuple"): only the
    lists a JSON file gives were read, so metadata built in-process as documented could not be rebuilt."""
    mesh = {"device_type": "cpu", "mesh_shape": (2,), "mesh_data": (0, 1), "mesh_dim_names": ("dp",)}
    spec = DeviceMeshSpec.from_dict(mesh)
    assert spec is get_device_mesh_spec("cpu", (2,), (0, 1), ("dp",))
    data = {
        "global_shape": (4, 2),
        "dtype": "torch.float32",
        "stride": (2, 1),
        "mesh_spec": mesh,
        "placements": ({"type": "Shard", "dim": 0},),
    }
    meta = DTensorShardingMetadata.from_dict(data)
    assert meta.global_shape == (4, 2) and meta.stride == (2, 1) and meta.mesh_spec is spec
    assert meta.placements == (ShardSpec(0),)
    group = GlobalObjectMetadata.from_dict({"sharding_metadata": meta._pack(), "ranks": (0, 1)})
    assert group.ranks == (0, 1) and group.sharding_metadata == meta
    with pytest.raises(ValueError, match="mesh_shape"):
        DeviceMeshSpec.from_dict({**mesh, "mesh_shape": "2"})  # a str is not a sequence of sizes


@pytest.mark.parametrize(("dtype", "newer"), [("torch.float4_e2m1fn_x4", True), ("torch.os.system", False), (7, False)])
def test_a_dtype_this_torch_does_not_know_is_a_newer_ones_not_damage(dtype: object, newer: bool) -> None:
    """Defect: a dtype a newer torch saved (its name well formed) was "names no torch dtype", damage."""
    mesh = {"device_type": "cpu", "mesh_shape": [1], "mesh_data": [0], "mesh_dim_names": ["dp"]}
    data = {"global_shape": [2], "dtype": dtype, "stride": [1], "mesh_spec": mesh, "placements": []}
    with pytest.raises(CorruptCheckpointError, match="dtype") as info:
        DTensorShardingMetadata.from_dict(data)
    assert isinstance(info.value, NewerCheckpointError) is newer, info.value
