"""Resharding slice arithmetic, in one process: every rank of both jobs is played by this process.

Ground truth is torch's own placement splitting (`Placement._split_tensor`) applied to the full
tensor; the resharder's output must match it bit for bit, and must read only what it needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    SafetensorsSerialization,
    TorchSerialization,
)
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.distributed_metadata import (
    DistributedItemMetadata,
    DistributedMetadata,
    GlobalObjectMetadata,
    build_distributed_metadata,
)
from torch_checkpointing.dtensor_metadata import (
    DTensorShardingMetadata,
    ReplicateSpec,
    ShardSpec,
    StridedShardSpec,
    get_device_mesh_spec,
)
from torch_checkpointing.dtensor_resharder import (
    DTensorResharder,
    compute_load_plans,
    compute_local_runs,
    compute_local_shard_info,
    plan_resharding,
)
from torch_checkpointing.errors import TemplateMismatchError
from torch_checkpointing.source_reader import open_flat_tensors
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

ITEM = "model"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64]
PATHS: list[tuple[Any, ...]] = [("w",), ("state", 0, "exp_avg"), ("layers", 1), ()]


class RemoteStorage(LocalFileSystemStorage):
    """A storage with no local paths (like an object store) that counts the bytes it serves."""

    def __init__(self) -> None:
        super().__init__(LocalFileSystemStorageConfig(use_direct_io=False))
        self.bytes_served = 0

    def local_path(self, path: Path) -> str | None:
        return None

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        self.bytes_served += length
        return super().read_range(path, offset, length)

    def read(self, path: Path, read_args: Any = None) -> bytes:
        data = super().read(path, read_args)
        self.bytes_served += len(data)
        return data


def local_storage() -> LocalFileSystemStorage:
    return LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=False))


def to_torch_placement(spec: Any) -> Any:
    if isinstance(spec, StridedShardSpec):
        return _StridedShard(spec.dim, split_factor=spec.split_factor)
    if isinstance(spec, ShardSpec):
        return Shard(spec.dim)
    return Replicate()


def torch_shard(full: torch.Tensor, md: DTensorShardingMetadata, rank: int) -> torch.Tensor:
    """The local tensor torch itself would give `rank` (placements applied left to right)."""
    coord = md.mesh_spec.get_coordinate(rank)
    assert coord is not None
    t = full
    for mesh_dim, spec in enumerate(md.placements):
        p = to_torch_placement(spec)
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(t, md.mesh_spec.mesh_shape[mesh_dim], with_padding=False)
        t = shards[coord[mesh_dim]]
    return t.contiguous().clone()


def nest(path: tuple[Any, ...], leaf: Any) -> Any:
    """A value holding `leaf` at `path`: a dict key, an optimizer-style int dict key, or a list index."""
    if path == ():
        return leaf
    if path == ("w",):
        return {"w": leaf}
    if path == ("state", 0, "exp_avg"):
        return {"state": {0: {"exp_avg": leaf}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    if path == ("layers", 1):
        return {"layers": [torch.zeros(1), leaf]}
    raise AssertionError(path)


@st.composite
def layouts(draw: Any, ndim: int, world: int | None = None) -> DTensorShardingMetadata:
    if world is None:
        world = draw(st.integers(1, 8))
    two_d = world >= 4 and world % 2 == 0 and draw(st.booleans())
    mesh_shape = (2, world // 2) if two_d else (world,)
    mesh_data = tuple(draw(st.permutations(range(world))))
    specs = []
    for _ in mesh_shape:
        choices = [st.just(ReplicateSpec())]
        if ndim:
            choices.append(st.builds(ShardSpec, st.integers(0, ndim - 1)))
            choices.append(st.builds(StridedShardSpec, st.integers(0, ndim - 1), st.integers(1, 3)))
        specs.append(draw(st.one_of(*choices)))
    return (mesh_shape, mesh_data, tuple(specs))  # type: ignore[return-value]


def make_md(shape: tuple[int, ...], dtype: torch.dtype, layout: Any) -> DTensorShardingMetadata:
    mesh_shape, mesh_data, specs = layout
    stride = torch.empty(shape).stride() if shape else ()
    return DTensorShardingMetadata(
        tuple(shape), str(dtype), tuple(stride), get_device_mesh_spec("cpu", mesh_shape, mesh_data, None), specs
    )


def write_source(
    tmp: Path, full: torch.Tensor, md: DTensorShardingMetadata, path: tuple[Any, ...], fmt: str
) -> DistributedMetadata:
    """Every source rank's file plus the gathered metadata, as the manager would write them."""
    world = len(md.mesh_spec.mesh_data)
    per_rank, layouts_ = [], []
    for rank in range(world):
        local = torch_shard(full, md, rank)
        if fmt == "torch":
            layout = None
            torch.save(nest(path, local), tmp / f"{ITEM}_{rank}.pt")
        else:
            layout = LayoutInfo(f"shards/{ITEM}_{rank}.safetensors", SafetensorsSerialization())
            (tmp / "shards").mkdir(exist_ok=True)
            save_file({".".join(str(c) for c in path): local.contiguous()}, str(tmp / layout.file_path))
        per_rank.append({ITEM: {path: md}})
        layouts_.append({ITEM: layout})
    dm = build_distributed_metadata(per_rank, layouts_, world)
    # Round-trip through JSON, as metadata.json would.
    return DistributedMetadata.from_dict(json.loads(json.dumps(dm.to_dict())))


def index_set(md: DTensorShardingMetadata, rank: int) -> set[int]:
    numel = 1
    for n in md.global_shape:
        numel *= n
    idx = torch.arange(numel).reshape(md.global_shape)
    return set(torch_shard(idx, md, rank).flatten().tolist())


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_reshard_matches_torch_ground_truth(tmp_path_factory: pytest.TempPathFactory, data: Any) -> None:
    ndim = data.draw(st.integers(0, 3), label="ndim")
    shape = tuple(data.draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim), label="shape"))
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    src_layout = data.draw(layouts(ndim), label="source")
    dst_layout = data.draw(layouts(ndim), label="target")
    fmt = data.draw(st.sampled_from(["torch", "safetensors", "safetensors-remote"]), label="format")
    path = data.draw(st.sampled_from(PATHS if fmt == "torch" else PATHS[:3]), label="path")
    tmp = tmp_path_factory.mktemp("src")

    gen = torch.Generator().manual_seed(len(shape) * 31 + sum(shape))
    full = (torch.randn(shape, generator=gen) * 100).to(dtype)
    src_md, dst_md = make_md(shape, dtype, src_layout), make_md(shape, dtype, dst_layout)
    dm = write_source(tmp, full, src_md, path, "torch" if fmt == "torch" else "safetensors")
    storage = RemoteStorage() if fmt == "safetensors-remote" else local_storage()
    resharder = DTensorResharder()

    for rank in dst_md.mesh_spec.mesh_data:
        expected = torch_shard(full, dst_md, rank)
        target_local = torch.zeros_like(expected) if expected.numel() else torch.empty_like(expected)
        assert compute_local_shard_info(dst_md, rank)[0] == tuple(expected.shape)
        if expected.numel():
            target_local.fill_(1 if dtype != torch.int64 else 3)  # make an untouched element visible
        target = nest(path, target_local)
        values = path == ("state", 0, "exp_avg")  # an optimizer-style item: non-tensor param_groups beside it
        if values:
            target["param_groups"][0]["lr"] = -1.0  # restored from the source (0.1), unless it holds no such value
        failed = resharder.load_as_rank(rank, tmp, ITEM, {path: dst_md}, dm.metadata[ITEM], target, storage)
        assert failed == ([("param_groups",)] if values and fmt != "torch" else [])  # safetensors: tensors only
        if values:
            assert target["param_groups"][0]["lr"] == (0.1 if fmt == "torch" else -1.0)
        assert torch.equal(target_local, expected), (rank, target_local, expected)

        stats = resharder.last_load_stats
        assert stats is not None
        elem = full.element_size()
        if fmt != "safetensors-remote":
            # Each target element is read exactly once, from one replica.
            assert stats.bytes_read == expected.numel() * elem
        needed = index_set(dst_md, rank)
        opened = {Path(p).name for p in stats.files_opened}
        # A rank reading no block still reads an optimizer-style item's param_groups, from source rank 0's file.
        for_values = {Path(dm.metadata[ITEM].get_file_path(0, tmp, ITEM)).name} if values and not needed else set()
        for src_rank in range(len(src_md.mesh_spec.mesh_data)):
            name = Path(dm.metadata[ITEM].get_file_path(src_rank, tmp, ITEM)).name
            if name in opened and name not in for_values:
                assert needed & index_set(src_md, src_rank), f"rank {rank} opened useless {name}"
        if expected.numel() == 0:
            assert opened <= for_values


def test_two_rank_shard_to_one_rank_replicated_plans() -> None:
    src = make_md((4, 2), torch.float32, ((2,), (0, 1), (ShardSpec(0),)))
    dst = make_md((4, 2), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    plans = compute_load_plans(("w",), dst, [GlobalObjectMetadata(src, (0, 1))], 0)
    assert plans is not None
    assert [(p.offsets, p.sizes, p.src_rank, p.src_offsets, p.src_fqn) for p in plans] == [
        ((0, 0), (2, 2), 0, (0, 0), "w"),
        ((2, 0), (2, 2), 1, (0, 0), "w"),
    ]
    assert plans[0].src_elem_size == 4 and plans[0].src_dtype == "torch.float32"


def test_strided_shard_matches_torch_docstring_example() -> None:
    # 8 rows, mesh [[0, 1], [2, 3]], [_StridedShard(0, sf=2), Shard(0)]: ranks hold rows 0-1, 4-5, 2-3, 6-7.
    md = make_md((8, 8), torch.float32, ((2, 2), (0, 1, 2, 3), (StridedShardSpec(0, 2), ShardSpec(0))))
    rows = {r: [(run.global_start, run.length) for run in compute_local_runs(md, r)[0]] for r in range(4)}
    assert rows == {0: [(0, 2)], 1: [(4, 2)], 2: [(2, 2)], 3: [(6, 2)]}


def test_strided_local_layout_becomes_several_contiguous_plans() -> None:
    # _StridedShard(0, sf=2) over 2 ranks: rank 0 holds rows {0, 1, 4, 5} of 8 (two runs).
    src = make_md((8,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    dst = make_md((8,), torch.float32, ((2,), (0, 1), (StridedShardSpec(0, 2),)))
    plans = compute_load_plans(("w",), dst, [GlobalObjectMetadata(src, (0,))], 0)
    assert plans is not None
    assert [(p.offsets, p.src_offsets, p.sizes) for p in plans] == [((0,), (0,), (2,)), ((2,), (4,), (2,))]


def test_replicas_are_read_once_from_lowest_rank() -> None:
    src = make_md((4,), torch.float32, ((2, 2), (3, 2, 1, 0), (ReplicateSpec(), ShardSpec(0))))
    dst = make_md((4,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    plans = compute_load_plans(("w",), dst, [GlobalObjectMetadata(src, (0, 1, 2, 3))], 0)
    assert plans is not None
    # mesh [[3, 2], [1, 0]]: rows 0-1 on ranks 3 and 1, rows 2-3 on ranks 2 and 0.
    assert sorted((p.src_rank, p.offsets) for p in plans) == [(0, (2,)), (1, (0,))]


def test_global_shape_mismatch_names_the_path() -> None:
    src = make_md((4,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    dst = make_md((5,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    with pytest.raises(ValueError, match=r"layer\.w.*\(4,\).*\(5,\)"):
        compute_load_plans(("layer", "w"), dst, [GlobalObjectMetadata(src, (0,))], 0)


def test_paths_missing_in_source_or_not_dtensor_are_reported(tmp_path: Path) -> None:
    md = make_md((4,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    torch.save({"w": torch.arange(4.0)}, tmp_path / f"{ITEM}_0.pt")
    src = DistributedItemMetadata({("w",): [GlobalObjectMetadata(md, (0,))]}, {0: None})
    target = {"w": torch.zeros(4), "b": torch.zeros(4)}
    failed = DTensorResharder().load_as_rank(0, tmp_path, ITEM, {("w",): md, ("b",): md}, src, target, local_storage())
    assert failed == [("b",)]
    assert torch.equal(target["w"], torch.arange(4.0))
    assert torch.equal(target["b"], torch.zeros(4))


def test_source_file_lacking_the_tensor_is_reported(tmp_path: Path) -> None:
    md = make_md((4,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    torch.save({"other": torch.arange(4.0)}, tmp_path / f"{ITEM}_0.pt")
    src = DistributedItemMetadata({("w",): [GlobalObjectMetadata(md, (0,))]}, {0: None})
    target = {"w": torch.zeros(4)}
    assert DTensorResharder().load_as_rank(0, tmp_path, ITEM, {("w",): md}, src, target, local_storage()) == [("w",)]


def test_json_source_holds_no_tensors(tmp_path: Path) -> None:
    md = make_md((2,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    (tmp_path / "m.json").write_text("{}")
    src = DistributedItemMetadata(
        {("w",): [GlobalObjectMetadata(md, (0,))]}, {0: LayoutInfo("m.json", JsonSerialization())}
    )
    target = {"w": torch.zeros(2)}
    assert DTensorResharder().load_as_rank(0, tmp_path, ITEM, {("w",): md}, src, target, local_storage()) == [("w",)]


def test_wrong_target_local_shape_is_a_clear_error(tmp_path: Path) -> None:
    src_md = make_md((4,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    dst_md = make_md((4,), torch.float32, ((2,), (0, 1), (ShardSpec(0),)))
    torch.save({"w": torch.arange(4.0)}, tmp_path / f"{ITEM}_0.pt")
    src = DistributedItemMetadata({("w",): [GlobalObjectMetadata(src_md, (0,))]}, {0: None})
    with pytest.raises(TemplateMismatchError, match=r"model::w has local shape \(4,\).*\(2,\)"):
        DTensorResharder().load_as_rank(
            1, tmp_path, ITEM, {("w",): dst_md}, src, {"w": torch.zeros(4)}, local_storage()
        )


def test_a_dtype_change_is_refused_like_a_direct_load_refuses_it(tmp_path: Path) -> None:
    """copy_() would convert float32 into the bfloat16 template silently; a direct load refuses the mismatch."""
    src_md = make_md((4,), torch.float32, ((2,), (0, 1), (ShardSpec(0),)))
    dst_md = make_md((4,), torch.bfloat16, ((1,), (0,), (ReplicateSpec(),)))
    for r in range(2):
        torch.save({"w": torch.arange(4.0)[2 * r : 2 * r + 2]}, tmp_path / f"{ITEM}_{r}.pt")
    src = DistributedItemMetadata({("w",): [GlobalObjectMetadata(src_md, (0, 1))]}, {0: None, 1: None})
    target = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    with pytest.raises(TemplateMismatchError, match=r"saved as torch\.float32 but the target is torch\.bfloat16"):
        DTensorResharder().load_as_rank(0, tmp_path, ITEM, {("w",): dst_md}, src, target, local_storage())
    assert not target["w"].any()


def test_remote_safetensors_reads_only_the_needed_rows(tmp_path: Path) -> None:
    # One source rank with 1000 rows; target rank 3 of 4 needs rows 750..999 only.
    full = torch.arange(4000, dtype=torch.float32).reshape(1000, 4)
    save_file({"w": full}, str(tmp_path / "m.safetensors"))
    src_md = make_md((1000, 4), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    dst_md = make_md((1000, 4), torch.float32, ((4,), (0, 1, 2, 3), (ShardSpec(0),)))
    src = DistributedItemMetadata(
        {("w",): [GlobalObjectMetadata(src_md, (0,))]}, {0: LayoutInfo("m.safetensors", SafetensorsSerialization())}
    )
    storage = RemoteStorage()
    target = {"w": torch.zeros(250, 4)}
    assert DTensorResharder().load_as_rank(3, tmp_path, ITEM, {("w",): dst_md}, src, target, storage) == []
    assert torch.equal(target["w"], full[750:])
    header_bytes = 8 + int.from_bytes((tmp_path / "m.safetensors").read_bytes()[:8], "little")
    assert storage.bytes_served == header_bytes + 250 * 4 * 4


def test_target_rank_outside_the_target_mesh_reads_nothing() -> None:
    src = make_md((4,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    dst = make_md((4,), torch.float32, ((2,), (0, 1), (ShardSpec(0),)))
    src_item = DistributedItemMetadata({("w",): [GlobalObjectMetadata(src, (0,))]}, {0: None})
    info = plan_resharding({("w",): dst}, src_item, 5)
    assert info.nested_path_to_load_plans == {("w",): []} and info.non_reshardable_paths == []
    with pytest.raises(ValueError, match="Rank 5 is not in the device mesh"):
        compute_local_shard_info(dst, 5)


def test_should_reshard_default_logic() -> None:
    a = make_md((4,), torch.float32, ((2,), (0, 1), (ShardSpec(0),)))
    b = make_md((4,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    src = DistributedItemMetadata({("w",): [GlobalObjectMetadata(a, (0, 1))]}, {0: None, 1: None})
    r = DTensorResharder()
    assert r.should_reshard(None, {("w",): a}) is False
    assert r.should_reshard(src, None) is False
    assert r.should_reshard(src, {("w",): a}) is False
    assert r.should_reshard(src, {("w",): b}) is True
    assert r.should_reshard(src, {("other",): b}) is False  # absent from the source: ignored


def test_default_resharder_is_the_dtensor_resharder() -> None:
    assert DefaultResharder is DTensorResharder
    assert DefaultResharder() == DTensorResharder()


def test_extract_walks_dicts_and_lists_and_warns_on_plain_tensors() -> None:
    value = {
        "w": torch.zeros(2, 3),
        "opt": {"state": {0: {"exp_avg": torch.zeros(2), "step": torch.tensor(3.0)}}},
        "layers": [1, torch.ones(1)],
        "lr": 0.1,
    }
    with pytest.warns(UserWarning, match="plain"):
        md = DTensorResharder().extract_sharding_metadata(ITEM, value)
    assert set(md) == {("w",), ("opt", "state", 0, "exp_avg"), ("opt", "state", 0, "step"), ("layers", 1)}
    step = md[("opt", "state", 0, "step")]
    assert isinstance(step, DTensorShardingMetadata)
    assert step.global_shape == () and step.placements == (ReplicateSpec(),) and step.mesh_spec.mesh_shape == (1,)


def test_open_flat_tensors_unwraps_and_uses_dotted_keys(tmp_path: Path) -> None:
    value = {"a": {"b": torch.ones(2), "c": [torch.zeros(1), torch.full((3,), 2.0)]}, "n": 1}
    torch.save(value, tmp_path / "x.pt")
    save_file({"a.b": torch.ones(2), "a.c.1": torch.full((3,), 2.0)}, str(tmp_path / "x.safetensors"))
    for name, fmt in [("x.pt", TorchSerialization()), ("x.safetensors", SafetensorsSerialization())]:
        for storage in (local_storage(), RemoteStorage()):
            flat = open_flat_tensors(storage, tmp_path / name, fmt)
            assert {"a.b", "a.c.1"} <= set(flat)
            assert torch.equal(flat["a.c.1"], torch.full((3,), 2.0)) and torch.equal(flat["a.b"], torch.ones(2))
            with pytest.raises(KeyError):
                flat["missing"]
