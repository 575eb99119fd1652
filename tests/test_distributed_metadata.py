"""Checkpoint-wide sharding metadata: registry, JSON round trip, consistency checks, gathering."""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization, TorchSerialization
from torch_checkpointing.distributed_metadata import (
    METADATA_FILE_NAME,
    CheckpointMetadata,
    DistributedItemMetadata,
    DistributedMetadata,
    GlobalObjectMetadata,
    ItemMetadata,
    ShardingMetadata,
    build_distributed_metadata,
    load_distributed_metadata,
    nested_path_from_json,
    nested_path_to_json,
)
from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata, ShardSpec, get_device_mesh_spec
from torch_checkpointing.errors import CorruptCheckpointError, NewerCheckpointError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig


@dataclass(frozen=True)
class RangeMetadata(ShardingMetadata, type_name="test.RangeMetadata"):
    """A custom metadata type, as a user's resharder would define one."""

    start: int
    stop: int

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "stop": self.stop}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RangeMetadata:
        return cls(d["start"], d["stop"])

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None


def storage() -> LocalFileSystemStorage:
    return LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=False))


def dtensor_md(world: int) -> DTensorShardingMetadata:
    return DTensorShardingMetadata(
        (8, 2),
        "torch.float32",
        (2, 1),
        get_device_mesh_spec("cpu", (world,), tuple(range(world)), ("dp",)),
        (ShardSpec(0),),
    )


def sample(world: int = 2) -> DistributedMetadata:
    per_rank = [
        {
            "model": {("w",): dtensor_md(world), ("layers", 0, "b"): dtensor_md(world)},
            "loader": {(): RangeMetadata(r * 10, r * 10 + 10)},
        }
        for r in range(world)
    ]
    layouts = [
        {"model": None, "loader": LayoutInfo(f"loader/{r}.safetensors", SafetensorsSerialization({"a": "b"}))}
        for r in range(world)
    ]
    return build_distributed_metadata(per_rank, layouts, world)


def test_registry_and_unpack_errors() -> None:
    """The packed form `{"type", "data"}` (API_SURFACE 5.3), seen through GlobalObjectMetadata's JSON dict."""
    packed = GlobalObjectMetadata(RangeMetadata(1, 2), (0,)).to_dict()["sharding_metadata"]
    assert packed == {"type": "test.RangeMetadata", "data": {"start": 1, "stop": 2}}
    assert GlobalObjectMetadata.from_dict({"sharding_metadata": packed, "ranks": [0]}).sharding_metadata == (
        RangeMetadata(1, 2)
    )
    with pytest.raises(ValueError, match="missing 'type'"):
        GlobalObjectMetadata.from_dict({"sharding_metadata": {"data": {}}, "ranks": [0]})
    with pytest.raises(
        ValueError,
        match=r"Unknown ShardingMetadata type 'Nope'\. Available types: .*"
        r"DTensorShardingMetadata.*test\.RangeMetadata",
    ):
        GlobalObjectMetadata.from_dict({"sharding_metadata": {"type": "Nope", "data": {}}, "ranks": [0]})


def test_json_round_trip_is_equal() -> None:
    dm = sample(3)
    as_json = json.loads(json.dumps(dm.to_dict()))
    assert set(as_json["metadata"]["model"]["rank_to_layout_info"]) == {"0", "1", "2"}
    back = DistributedMetadata.from_dict(as_json)
    assert back == dm
    assert DistributedMetadata.from_json(dm.to_json()) == dm
    assert back.metadata["model"].get_nested_paths() == {("w",), ("layers", 0, "b")}


def test_build_groups_equal_metadata() -> None:
    dm = sample(2)
    model = dm.metadata["model"]
    assert model.nested_path_to_metadata[("w",)] == [GlobalObjectMetadata(dtensor_md(2), (0, 1))]
    loader = dm.metadata["loader"]
    assert loader.nested_path_to_metadata[()] == [
        GlobalObjectMetadata(RangeMetadata(0, 10), (0,)),
        GlobalObjectMetadata(RangeMetadata(10, 20), (1,)),
    ]
    assert loader.get_metadata_for_path_and_rank((), 1) == RangeMetadata(10, 20)
    assert loader.get_metadata_for_path_and_rank(("x",), 1) is None
    assert loader.get_all_ranks() == {0, 1}


def test_per_rank_metadata_pickles_for_all_gather_object() -> None:
    per_rank: dict[str, ItemMetadata] = {"model": {("w",): dtensor_md(2)}, "loader": {(): RangeMetadata(0, 1)}}
    assert pickle.loads(pickle.dumps(per_rank)) == per_rank


def test_build_rejects_wrong_counts() -> None:
    with pytest.raises(ValueError, match="one entry per rank: world_size=3"):
        build_distributed_metadata([{}, {}], [{}, {}], 3)


def test_get_file_path_default_and_custom() -> None:
    dm = sample(2)
    root = Path("ckpt")
    assert dm.metadata["model"].get_file_path(1, root, "model") == root / "model_1.pt"
    assert dm.metadata["model"].get_layout(1, "model") == LayoutInfo("model_1.pt", TorchSerialization())
    assert dm.metadata["loader"].get_file_path(1, root, "loader") == root / "loader/1.safetensors"


def test_post_init_requires_every_rank() -> None:
    item = DistributedItemMetadata({}, {0: None, 2: None})
    with pytest.raises(RuntimeError, match=r"Item 'm' .*Missing ranks: \[1\], Extra ranks: \[2\]"):
        DistributedMetadata({"m": item}, world_size=2)


def test_post_init_refuses_shared_file_paths() -> None:
    same = LayoutInfo("shared.pt", TorchSerialization())
    with pytest.raises(
        RuntimeError,
        match=r"Item 'a' rank 0 & item 'a' rank 1 both write to the same file path "
        r"shared\.pt",
    ):
        DistributedMetadata({"a": DistributedItemMetadata({}, {0: same, 1: same})}, world_size=2)
    with pytest.raises(RuntimeError, match="Item 'a' rank 0 & item 'b' rank 0"):
        DistributedMetadata(
            {"a": DistributedItemMetadata({}, {0: same}), "b": DistributedItemMetadata({}, {0: same})}, world_size=1
        )


def test_nested_paths_keep_int_and_str_components() -> None:
    for path in [(), ("w",), ("state", 0, "exp_avg"), ("0", 0)]:
        assert nested_path_from_json(nested_path_to_json(path)) == path
    assert nested_path_to_json(("l", 0)) == '["l",0]'
    with pytest.raises(ValueError, match=r"component frozenset\(\) of type frozenset"):
        nested_path_to_json(("a", frozenset()))


def test_unknown_version_is_refused() -> None:
    d = sample(1).to_dict()
    d["version"] = "9.9"
    with pytest.raises(NewerCheckpointError, match="'version' is '9.9'.*newer engine"):
        DistributedMetadata.from_dict(d)
    d["version"] = "nine"
    with pytest.raises(ValueError, match="Unsupported sharding metadata version 'nine'"):
        DistributedMetadata.from_dict(d)


def test_load_distributed_metadata(tmp_path: Path) -> None:
    assert METADATA_FILE_NAME == "metadata.json"
    assert load_distributed_metadata(tmp_path, storage()) is None
    dm = sample(2)
    (tmp_path / METADATA_FILE_NAME).write_text(dm.to_json())
    assert load_distributed_metadata(str(tmp_path), storage()) == dm
    (tmp_path / METADATA_FILE_NAME).write_text('{"metadata": {}, "world_size": 1}')
    with pytest.raises(CorruptCheckpointError, match="metadata.json is malformed"):
        load_distributed_metadata(tmp_path, storage())


def test_checkpoint_metadata_holds_both_views() -> None:
    dm = sample(1)
    cm = CheckpointMetadata(dm, {"model": {("w",): dtensor_md(1)}})
    assert cm.distributed_metadata is dm and cm.local_metadata["model"][("w",)] == dtensor_md(1)


def test_custom_resharder_example_in_docs_runs() -> None:
    """The 'Writing a resharder' example is executed as written, so the docs cannot drift."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    section = doc.split("## Writing a resharder", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "no python example under 'Writing a resharder'"
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(compile(code.group(1), "docs/distributed.md", "exec", dont_inherit=True), namespace)
    assert "MyCustomDataloaderResharder" in namespace


def _sound_metadata() -> dict[str, Any]:
    mesh = get_device_mesh_spec("cpu", (1,), (0,), None)
    meta = DTensorShardingMetadata((4,), "torch.float32", (1,), mesh, (ShardSpec(0),))
    item = DistributedItemMetadata({("w",): [GlobalObjectMetadata(meta, (0,))]}, {0: None})
    return json.loads(json.dumps(DistributedMetadata({"model": item}, world_size=1).to_dict()))


def _data(d: dict[str, Any]) -> dict[str, Any]:
    return d["metadata"]["model"]["nested_path_to_metadata"]['["w"]'][0]["sharding_metadata"]["data"]


@pytest.mark.parametrize(
    ("where", "bad"),
    [
        ("metadata", lambda d: d.update(metadata=[])),
        ("model", lambda d: d["metadata"].update(model="x")),
        ("nested_path_to_metadata", lambda d: d["metadata"]["model"].update(nested_path_to_metadata=[1])),
        ("rank_to_layout_info", lambda d: d["metadata"]["model"].update(rank_to_layout_info=None)),
        ("placements", lambda d: _data(d).update(placements="ab")),
        ("placements", lambda d: _data(d).update(placements=[5])),
        ("placements", lambda d: _data(d).update(placements=None)),
        ("mesh_spec", lambda d: _data(d).update(mesh_spec=[1])),
    ],
)
def test_from_dict_names_the_field_whose_json_has_the_wrong_shape(where: str, bad: Any) -> None:
    """API_SURFACE §5.3: `DistributedMetadata.from_dict` reads metadata.json, untrusted input; a wrong value is a
    ValueError naming its field, as a wrong number already was. An array where an object belongs (or a str where
    the placements array belongs) escaped as AttributeError/TypeError ("'list' object has no attribute 'items'")."""
    d = _sound_metadata()
    assert DistributedMetadata.from_dict(json.loads(json.dumps(d))).world_size == 1
    bad(d)
    with pytest.raises(ValueError, match=where):
        DistributedMetadata.from_dict(d)
