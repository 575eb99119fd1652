"""Crafted sharding metadata against resharding loads: refused naming the file and field, nothing copied.

An attacker (or a damaged tool) controls metadata.json and can forge the manifest to match, so every field a
planner computes with is untrusted: a mesh of zero or negative size, a split factor of 0 or 2**40 (a division
by zero, a loop that never ends), ranks the save never had, dtypes and shapes that disagree with the file,
groups that overlap and leave a gap. Each must be a `CorruptCheckpointError` naming metadata.json (or the
source file) and the field, raised in bounded time before anything is copied into the caller's template.
"""

from __future__ import annotations

import contextlib
import copy
import json
import signal
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from tests.test_reshard_plans import ITEM, RemoteStorage, local_storage, make_md
from tests.test_verified_loads import _reshard_load, _reshard_save, _rewrite_metadata
from torch_checkpointing.distributed_metadata import (
    DistributedItemMetadata,
    GlobalObjectMetadata,
    parse_distributed_metadata,
)
from torch_checkpointing.dtensor_metadata import ReplicateSpec, ShardSpec
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import CorruptCheckpointError

BOUND_S = 20.0  # any refusal below must come well within this

Edit = Callable[[dict[str, Any]], None]


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Fail with TimeoutError (a real SIGALRM) if the body runs longer than `seconds`: a hang is a failure."""

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    # Repeated each second: the engine holds SIGALRM where it holds Ctrl-C (a load's copy phase), and only the
    # same signal once more interrupts a block that hangs there.
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _group(d: dict[str, Any]) -> dict[str, Any]:
    group: dict[str, Any] = d["metadata"]["model"]["nested_path_to_metadata"]['["w"]'][0]
    return group


def _paths(d: dict[str, Any]) -> dict[str, Any]:
    paths: dict[str, Any] = d["metadata"]["model"]["nested_path_to_metadata"]
    return paths


def _md(d: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = _group(d)["sharding_metadata"]["data"]
    return data


def _placements(*placements: dict[str, Any]) -> Edit:
    return lambda d: _md(d).update(placements=list(placements))


def _mesh(**fields: Any) -> Edit:
    return lambda d: _md(d)["mesh_spec"].update(**fields)


def _two_meshes(d: dict[str, Any]) -> None:
    _md(d)["mesh_spec"].update(mesh_shape=[-1, -1])
    _md(d).update(placements=[{"type": "Shard", "dim": 0}, {"type": "Shard", "dim": 0}])


def _duplicate_group(d: dict[str, Any]) -> None:
    groups = d["metadata"]["model"]["nested_path_to_metadata"]['["w"]']
    other = copy.deepcopy(groups[0])
    other["sharding_metadata"]["data"]["global_shape"] = [8192]
    groups.insert(0, other)


def _foreign_mesh_rank(d: dict[str, Any]) -> None:
    _md(d)["mesh_spec"].update(mesh_data=[5])
    _group(d).update(ranks=[5])


def _rank_twice(d: dict[str, Any]) -> None:
    _md(d)["mesh_spec"].update(mesh_shape=[2], mesh_data=[0, 0])
    _md(d).update(placements=[{"type": "Shard", "dim": 0}])


CRAFTS: dict[str, tuple[Edit, str]] = {
    "unknown dtype": (lambda d: _md(d).update(dtype="torch.foo"), "dtype"),
    "negative global shape": (lambda d: _md(d).update(global_shape=[-4096]), "global_shape"),
    "fractional global shape": (lambda d: _md(d).update(global_shape=[4096.7]), "global_shape"),
    "global shape of 2**70 elements": (lambda d: _md(d).update(global_shape=[2**35, 2**35]), "global_shape"),
    "stride of another rank": (lambda d: _md(d).update(stride=[-3, 5]), "stride"),
    "fractional shard dim": (_placements({"type": "Shard", "dim": 0.5}), "dim"),
    "split factor 0": (_placements({"type": "StridedShard", "dim": 0, "split_factor": 0}), "split_factor"),
    "negative split factor": (_placements({"type": "StridedShard", "dim": 0, "split_factor": -1}), "split_factor"),
    "split factor 2**40": (_placements({"type": "StridedShard", "dim": 0, "split_factor": 2**40}), "split_factor"),
    "empty mesh": (_mesh(mesh_shape=[0], mesh_data=[]), "mesh_shape"),
    "negative mesh sizes": (_two_meshes, "mesh_shape"),
    "device type not a string": (_mesh(device_type=5), "device_type"),
    "a rank the save never had": (lambda d: _group(d).update(ranks=[0, 7]), "world_size"),
    "a mesh naming a rank the save never had": (_foreign_mesh_rank, "world_size"),
    "one rank in two groups": (_duplicate_group, "rank 0"),
    "a mesh listing a rank twice": (_rank_twice, "twice"),
    "a path with no groups": (lambda d: _paths(d).update({'["w"]': []}), "nested_path_to_metadata"),
    "groups not a list": (lambda d: _paths(d).update({'["w"]': {}}), "nested_path_to_metadata"),
    "a group not an object": (lambda d: _paths(d).update({'["w"]': [7]}), "nested_path_to_metadata"),
}


@pytest.mark.parametrize("name", sorted(CRAFTS))
def test_crafted_sharding_metadata_is_refused_naming_the_file_and_field(tmp_path: Path, name: str) -> None:
    edit, field = CRAFTS[name]
    root, _ = _reshard_save(tmp_path)
    _rewrite_metadata(root, edit)
    with bounded(BOUND_S), pytest.raises(CorruptCheckpointError) as caught:
        _reshard_load(root)
    message = str(caught.value)
    assert "metadata.json" in message and field in message, message


def test_a_group_naming_a_rank_outside_its_own_mesh_is_refused(tmp_path: Path) -> None:
    """Two ranks saved; rank 0 reports a layout on a mesh holding only rank 1, which no DTensor of rank 0 has."""
    root, _ = _reshard_save(tmp_path)
    d = json.loads((root / "metadata.json").read_text())
    d["world_size"] = 2
    d["metadata"]["model"]["rank_to_layout_info"]["1"] = None
    _mesh(mesh_data=[1])(d)
    with pytest.raises(CorruptCheckpointError, match=r"metadata\.json.*\[0\].*mesh does not hold"):
        parse_distributed_metadata(json.dumps(d).encode(), str(root / "metadata.json"))


def test_metadata_dtype_differing_from_the_files_is_refused_naming_the_file(tmp_path: Path) -> None:
    root, _ = _reshard_save(tmp_path)
    _rewrite_metadata(root, lambda d: _md(d).update(dtype="torch.float64"))
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt.*torch\.float32.*torch\.float64"):
        _reshard_load(root)


# ------------------------------------------------------------------------- the planner, on real files


def _load(
    tmp_path: Path, groups: list[GlobalObjectMetadata], world: int, target: torch.Tensor, storage: Any = None
) -> list[Any]:
    dst = make_md(tuple(target.shape), target.dtype, ((1,), (0,), (ReplicateSpec(),)))
    src = DistributedItemMetadata({("w",): groups}, dict.fromkeys(range(world)))
    storage = storage if storage is not None else local_storage()
    return DTensorResharder().load_as_rank(0, tmp_path, ITEM, {("w",): dst}, src, {"w": target}, storage)


def _shard_md(shape: int, mesh_data: tuple[int, ...]) -> Any:
    return make_md((shape,), torch.float32, ((len(mesh_data),), mesh_data, (ShardSpec(0),)))


def test_source_blocks_that_overlap_and_leave_a_gap_are_refused_not_half_filled(tmp_path: Path) -> None:
    """Rank 0 holds [0, 4), rank 1 [2, 4), rank 2 [6, 8): 8 elements in all, as the target needs, but [4, 6)
    is in no file. Counting elements took that for a cover and left [4, 6) as the template had it."""
    full = torch.arange(8.0)
    for rank, part in enumerate((full[0:4], full[2:4], full[6:8])):
        torch.save({"w": part.clone()}, tmp_path / f"{ITEM}_{rank}.pt")
    groups = [
        GlobalObjectMetadata(_shard_md(8, (0, 1)), (0,)),
        GlobalObjectMetadata(_shard_md(8, (0, 1, 2, 3)), (1,)),
        GlobalObjectMetadata(_shard_md(8, (0, 1, 3, 2)), (2,)),
    ]
    target = torch.full((8,), -1.0)
    with pytest.raises(CorruptCheckpointError, match=r"w.*overlap"):
        _load(tmp_path, groups, 3, target)
    assert torch.equal(target, torch.full((8,), -1.0))


@pytest.mark.parametrize("layout", ["replicated beside sharded", "two shard counts"])
def test_replica_groups_laying_one_tensor_out_differently_are_not_called_damaged(tmp_path: Path, layout: str) -> None:
    """Each group is a whole copy of the tensor (two replica groups, one per sub-mesh), so any one of them fills
    the target. Pooled together their blocks overlap unequally, and the planner called that checkpoint, which our
    own save writes, damaged ("no save lays a tensor out so"): an operator deletes what is reported damaged."""
    full = torch.arange(8.0)
    first: tuple[tuple[int, ...], Any] = ((0, 1), make_md((8,), torch.float32, ((2,), (0, 1), (ReplicateSpec(),))))
    if layout == "two shard counts":
        first = ((0, 1, 2), _shard_md(8, (0, 1, 2)))
    second = tuple(range(len(first[0]), len(first[0]) + 2))
    groups = [GlobalObjectMetadata(first[1], first[0]), GlobalObjectMetadata(_shard_md(8, second), second)]
    pieces = [full.clone()] * 2 if layout != "two shard counts" else list(full.split(3))
    for rank, part in enumerate([*pieces, full[:4], full[4:]]):
        torch.save({"w": part.clone()}, tmp_path / f"{ITEM}_{rank}.pt")
    target = torch.full((8,), -1.0)
    assert _load(tmp_path, groups, len(first[0]) + 2, target) == []
    assert torch.equal(target, full)


def test_groups_disagreeing_on_the_global_shape_are_corrupt_not_a_changed_model(tmp_path: Path) -> None:
    for rank in range(2):
        torch.save({"w": torch.zeros(4)}, tmp_path / f"{ITEM}_{rank}.pt")
    groups = [
        GlobalObjectMetadata(_shard_md(8, (0, 1)), (0,)),
        GlobalObjectMetadata(_shard_md(16, (0, 1, 2, 3)), (1,)),
    ]
    with pytest.raises(CorruptCheckpointError, match=r"w.*global shape.*\(8,\).*\(16,\)"):
        _load(tmp_path, groups, 2, torch.zeros(8))


def test_a_source_tensor_larger_than_its_metadata_says_is_refused(tmp_path: Path) -> None:
    """Rank 0 of a 2-way Shard(0) of 8 elements holds 4; a file holding 6 would be read at the wrong place."""
    torch.save({"w": torch.arange(6.0)}, tmp_path / f"{ITEM}_0.pt")
    torch.save({"w": torch.arange(4.0, 8.0)}, tmp_path / f"{ITEM}_1.pt")
    target = torch.full((8,), -1.0)
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt.*\(6,\).*\(4,\)"):
        _load(tmp_path, [GlobalObjectMetadata(_shard_md(8, (0, 1)), (0, 1))], 2, target)
    assert torch.equal(target, torch.full((8,), -1.0))


def _shorten_storage_record(file: Path, keep: int) -> None:
    """Rewrite a torch zip file with its one tensor record cut to `keep` bytes, the pickle unchanged."""
    with zipfile.ZipFile(file) as zin:
        entries = [(name, zin.read(name)) for name in zin.namelist()]
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED) as zout:
        for name, data in entries:
            zout.writestr(name, data[:keep] if name.endswith("/data/0") else data)


@pytest.mark.parametrize("remote", [False, True])
def test_a_tensor_record_shorter_than_its_storage_is_refused_not_read_past(tmp_path: Path, remote: bool) -> None:
    """torch's memory-mapped load does not check a record's size: a tensor of 8 floats whose record holds 16
    bytes came back with the zip entries after it as its last 4 values. Read whole (a store without local
    paths), torch refuses it with a bare RuntimeError."""
    md = make_md((8,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    file = tmp_path / f"{ITEM}_0.pt"
    torch.save({"w": torch.arange(8.0)}, file)
    _shorten_storage_record(file, 16)
    target = torch.full((8,), -1.0)
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt.*(32 bytes.*16|16 bytes.*32)"):
        _load(tmp_path, [GlobalObjectMetadata(md, (0,))], 1, target, RemoteStorage() if remote else None)
    assert torch.equal(target, torch.full((8,), -1.0))
