"""The resharding planner and the metadata file at scale: the indexed planner agrees with the brute-force one,
its work per target rank does not grow with the number of source ranks, and metadata version 3.0 stays small
while version 2.0 files (every checkpoint written before it) still read."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.golden.cases import DTENSOR_CASE, GOLDEN_DIR
from torch_checkpointing.distributed_metadata import (
    DistributedMetadata,
    GlobalObjectMetadata,
    build_distributed_metadata,
    decode_rank_list,
    encode_rank_list,
    parse_distributed_metadata,
)
from torch_checkpointing.dtensor_metadata import (
    DTensorShardingMetadata,
    PlacementSpec,
    ReplicateSpec,
    ShardSpec,
    StridedShardSpec,
    get_device_mesh_spec,
)
from torch_checkpointing.dtensor_resharder import (
    PlanStats,
    _brute_force_plans,
    _indexed_plans,
    compute_load_plans,
    plan_resharding,
)
from torch_checkpointing.errors import CorruptCheckpointError


def make_md(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], mesh_data: tuple[int, ...], specs: tuple[PlacementSpec, ...]
) -> DTensorShardingMetadata:
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensorShardingMetadata(
        shape, "torch.float32", stride, get_device_mesh_spec("cpu", mesh_shape, mesh_data), specs
    )


@st.composite
def layouts(draw: Any, shape: tuple[int, ...]) -> DTensorShardingMetadata:
    """A 1- to 3-D mesh over a permuted rank order, each dim Replicate, Shard or _StridedShard (uneven sizes too)."""
    mesh_shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    world = math.prod(mesh_shape)
    mesh_data = tuple(draw(st.permutations(range(world))))
    specs: list[PlacementSpec] = []
    for _ in mesh_shape:
        choices: list[Any] = [st.just(ReplicateSpec())]
        if shape:
            dims = st.integers(0, len(shape) - 1)
            choices += [st.builds(ShardSpec, dims), st.builds(StridedShardSpec, dims, st.integers(1, 4))]
        specs.append(draw(st.one_of(*choices)))
    return make_md(shape, mesh_shape, mesh_data, tuple(specs))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_indexed_planner_matches_brute_force(data: Any) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 13), min_size=0, max_size=3), label="shape"))
    src = data.draw(layouts(shape), label="source")
    dst = data.draw(layouts(shape), label="target")
    group = [GlobalObjectMetadata(src, tuple(sorted(src.mesh_spec.mesh_data)))]
    for rank in dst.mesh_spec.mesh_data:
        expected = _brute_force_plans(("w",), dst, group, rank)
        assert expected is not None  # one group holding every rank always covers the tensor
        assert _indexed_plans(("w",), dst, src, rank, PlanStats()) == expected
        assert compute_load_plans(("w",), dst, group, rank) == expected


def test_layouts_the_index_does_not_take_use_brute_force() -> None:
    # Two groups for one path (ranks disagreeing on the metadata): the brute-force rule "first group that
    # lists the rank" decides, and the answer equals the brute-force planner's.
    src = make_md((8,), (4,), (0, 1, 2, 3), (ShardSpec(0),))
    other = make_md((8,), (4,), (0, 1, 3, 2), (ShardSpec(0),))
    dst = make_md((8,), (1,), (0,), (ReplicateSpec(),))
    groups = [GlobalObjectMetadata(src, (0, 1)), GlobalObjectMetadata(other, (2, 3))]
    plans = compute_load_plans(("w",), dst, groups, 0)
    assert plans == _brute_force_plans(("w",), dst, groups, 0)
    assert plans is not None and [p.src_rank for p in plans] == [0, 1, 2, 3]
    assert [p.offsets for p in plans] == [(0,), (2,), (6,), (4,)]


def fsdp_tp(shape: tuple[int, ...], dp: int, tp: int, tp_spec: PlacementSpec) -> DTensorShardingMetadata:
    return make_md(shape, (dp, tp), tuple(range(dp * tp)), (ShardSpec(0), tp_spec))


def one_rank_work(src_dp: int, dst_dp: int, planner: str) -> PlanStats:
    """Planner work for target rank 5 of a dst_dp x 8 job loading a src_dp x 8 save of three tensors."""
    shapes = {
        ("wq",): ((8192, 8192), ShardSpec(0)),
        ("wo",): ((8192, 8192), ShardSpec(1)),
        ("norm",): ((8192,), ReplicateSpec()),
    }
    stats = PlanStats()
    for path, (shape, tp_spec) in shapes.items():
        src = fsdp_tp(shape, src_dp, 8, tp_spec)
        dst = fsdp_tp(shape, dst_dp, 8, tp_spec)
        group = [GlobalObjectMetadata(src, src.mesh_spec.mesh_data)]
        plans = (
            compute_load_plans(path, dst, group, 5, stats)
            if planner == "indexed"
            else _brute_force_plans(path, dst, group, 5, stats)
        )
        assert plans
    return stats


@pytest.mark.parametrize("direction", ["up", "down"])
def test_work_per_target_rank_does_not_grow_with_source_ranks(direction: str) -> None:
    worlds = [8, 32, 128, 512]  # x 8 TP: 64 to 4096 source ranks
    work = [
        one_rank_work(dp, 2 * dp, "indexed") if direction == "up" else one_rank_work(2 * dp, dp, "indexed")
        for dp in worlds
    ]
    assert len({w.chunk_checks for w in work}) == 1, [w.chunk_checks for w in work]
    assert len({w.sources for w in work}) == 1
    # The check can fail: the brute-force planner's work is proportional to the source world.
    brute = [one_rank_work(dp, 2 * dp, "brute").chunk_checks for dp in worlds]
    assert brute == [3 * dp * 8 for dp in worlds]


def test_plan_resharding_counts_work_into_given_stats() -> None:
    src = fsdp_tp((64, 64), 4, 2, ShardSpec(1))
    dst = fsdp_tp((64, 64), 8, 2, ShardSpec(1))
    source = build_distributed_metadata([{"m": {("w",): src}}] * 8, [{"m": None}] * 8, 8).metadata["m"]
    stats = PlanStats()
    info = plan_resharding({("w",): dst}, source, 3, stats)
    assert info.non_reshardable_paths == []
    assert stats.sources == 1 and stats.chunk_checks > 0


# -- metadata.json: version 3.0 (compact) and version 2.0 (explicit) ------------------------------------


def model_metadata(dp: int, tp: int, tensors: int) -> DistributedMetadata:
    world = dp * tp
    local = {"model": {(f"w{i}",): fsdp_tp((4096, 1024), dp, tp, ShardSpec(1)) for i in range(tensors)}}
    return build_distributed_metadata([local] * world, [{"model": None}] * world, world)


def test_compact_metadata_round_trip_and_size_independent_of_world() -> None:
    sizes = {}
    for dp in (16, 128):
        meta = model_metadata(dp, 8, 4)
        text = meta.to_json()
        assert json.loads(text)["version"] == "3.0"
        parsed = parse_distributed_metadata(text.encode(), "metadata.json")
        assert parsed == meta
        paths = parsed.metadata["model"].nested_path_to_metadata
        # Equal rank lists decode to one shared tuple, not one per tensor.
        assert paths[("w0",)][0].ranks is paths[("w3",)][0].ranks
        assert paths[("w0",)][0].ranks == tuple(range(dp * 8))
        body = json.loads(text)["metadata"]["model"]["nested_path_to_metadata"]
        sizes[dp] = len(json.dumps(body))
    # Per-tensor entries list no ranks: 8x the ranks changes only a few digits (mesh shape, run counts).
    assert abs(sizes[128] - sizes[16]) < 64, sizes


def test_version_2_metadata_still_reads_and_rewrites_as_2() -> None:
    meta = model_metadata(4, 2, 2)
    old = DistributedMetadata(meta.metadata, meta.world_size, version="2.0")
    d = old.to_dict()
    group = d["metadata"]["model"]["nested_path_to_metadata"]['["w0"]'][0]
    assert group["ranks"] == list(range(8))
    assert group["sharding_metadata"]["data"]["mesh_spec"]["mesh_data"] == list(range(8))
    parsed = parse_distributed_metadata(json.dumps(d).encode(), "metadata.json")
    assert parsed.version == "2.0" and parsed.metadata == meta.metadata
    assert parsed.to_dict() == d


def test_committed_version_2_checkpoint_metadata_reads() -> None:
    path = GOLDEN_DIR / "ours" / DTENSOR_CASE / "metadata.json"
    raw = json.loads(path.read_bytes())
    assert raw["version"] == "2.0"
    parsed = parse_distributed_metadata(path.read_bytes(), str(path))
    group = parsed.metadata["model"].nested_path_to_metadata[("i",)][0]
    assert group.ranks == (0, 1)


@pytest.mark.parametrize(
    ("ranks", "encoded"),
    [
        (tuple(range(2048)), {"runs": [[0, 2048, 1]]}),
        (tuple(r * 8 + c for c in range(8) for r in range(128)), {"runs": [[c, 128, 8] for c in range(8)]}),
        ((3, 2, 1, 0, 7, 6, 5, 4), {"runs": [[3, 4, -1], [7, 4, -1]]}),
        ((0, 2, 1, 3), [0, 2, 1, 3]),  # runs would not be shorter
        ((5,), [5]),
        ((), []),
    ],
)
def test_rank_list_encoding(ranks: tuple[int, ...], encoded: Any) -> None:
    assert encode_rank_list(ranks) == encoded
    assert decode_rank_list(json.loads(json.dumps(encoded)), "ranks") == ranks


@pytest.mark.parametrize(
    "bad",
    [
        {"runs": [[0, 0, 1]]},
        {"runs": [[2, 4, -1]]},
        {"runs": [[0, 2, 1, 9]]},
        {"runs": [[0, True, 1]]},
        {"runs": [[0, 2, 1]], "extra": 1},
        {"runs": [[0, 1 << 21, 1]]},
        [0, -1],
        "0-7",
    ],
)
def test_bad_rank_lists_are_corrupt_metadata(bad: Any, tmp_path: Path) -> None:
    d = model_metadata(2, 1, 1).to_dict()
    d["metadata"]["model"]["nested_path_to_metadata"]['["w0"]'][0]["ranks"] = bad
    with pytest.raises(CorruptCheckpointError, match="metadata.json.*ranks"):
        parse_distributed_metadata(json.dumps(d).encode(), str(tmp_path / "metadata.json"))


def test_run_expansion_is_bounded_per_file(tmp_path: Path) -> None:
    # Distinct million-rank lists are cheap to write as runs; one file may not make this process expand
    # more than the decode budget.
    d = model_metadata(2, 1, 1).to_dict()
    paths = d["metadata"]["model"]["nested_path_to_metadata"]
    template = paths['["w0"]'][0]
    for i in range(40):
        paths[json.dumps([f"x{i}"])] = [{**template, "ranks": {"runs": [[i, (1 << 20) - i, 1]]}}]
    with pytest.raises(CorruptCheckpointError, match="more ranks than a metadata file may describe"):
        parse_distributed_metadata(json.dumps(d).encode(), str(tmp_path / "metadata.json"))
