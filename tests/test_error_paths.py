"""The less travelled paths: configuration errors, threaded writes, JSON rebuilding corners, merge corners."""

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.checkpoint_writer import (
    CheckpointWriterConfig,
    SavePlan,
    WriteEntry,
    WriteRequest,
    write_checkpoint,
)
from torch_checkpointing.config import CheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.json_dataclass import from_jsonable, to_jsonable
from torch_checkpointing.schema import resolve
from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
from torch_checkpointing.walk_utils import walk_checkpoint_structure

STORAGE = LocalFileSystemStorageConfig(use_direct_io=False)


def test_manager_config_type_errors_name_the_field() -> None:
    with pytest.raises(TypeError, match="Config.items must be a Mapping"):
        CheckpointManager(CheckpointManager.Config(items=[("a", ItemSpec())]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Config.items\['a'\] must be an ItemSpec"):
        CheckpointManager(CheckpointManager.Config(items={"a": {"requires_copy": False}}))  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="Config.default must be an ItemSpec or None"):
        CheckpointManager(CheckpointManager.Config(default="strict"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Unsupported saver_config type: CheckpointSaverConfig"):
        CheckpointManager(CheckpointManager.Config(save=CheckpointSaverConfig(), storage_config=STORAGE))


def test_resolve_type_errors() -> None:
    with pytest.raises(TypeError, match="must be a Mapping"):
        resolve([("a", 1)], {}, ItemSpec(), 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Config.items\['a'\] must be an ItemSpec"):
        resolve({"a": 1}, {"a": object()}, ItemSpec(), 0)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="must be a LayoutInfo or None"):
        resolve({"a": 1}, {"a": ItemSpec(layout="a.pt")}, None, 0)  # type: ignore[arg-type]


def test_writer_config_rejects_zero_threads() -> None:
    with pytest.raises(ValueError, match="file_write_max_threads must be positive"):
        CheckpointWriterConfig(file_write_max_threads=0)


def test_threaded_file_writes_produce_the_same_checkpoint(tmp_path: Path) -> None:
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(writer_config=CheckpointWriterConfig(file_write_max_threads=3)),
        storage_config=STORAGE,
    )
    payload = {f"k{i}": torch.full((64,), float(i)) for i in range(5)}
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "c"), payload)
        out = manager.load(str(tmp_path / "c"), into=dict.fromkeys(payload))
    assert all(torch.equal(out[k], v) for k, v in payload.items())


def test_writer_refuses_two_records_for_one_path(tmp_path: Path) -> None:
    entries = [WriteEntry(k, "same.pt", TorchSerialization(), torch.ones(1)) for k in ("a", "b")]
    request = WriteRequest(
        SavePlan(checkpoint_dir=str(tmp_path / "c"), tmp_dir=str(tmp_path / ".c.tmp"), rank=0, world_size=1), entries
    )
    with pytest.raises(RuntimeError, match="both wrote 'same.pt'"):
        write_checkpoint(LocalFileSystemStorage(STORAGE), request)
    assert not (tmp_path / "c").exists() and not (tmp_path / ".c.tmp").exists()


@dataclass
class Inner:
    n: int
    tags: tuple[str, ...] = ()


@dataclass
class Outer:
    inner: Inner
    maybe: Optional[Inner]  # noqa: UP045 (typing.Optional on purpose: both spellings must work)
    rest: dict[str, Inner] = field(default_factory=dict)
    ids: set[int] = field(default_factory=set)
    ratio: float = 1.0


def test_json_dataclass_rebuild_corners() -> None:
    data = {"inner": {"n": 1, "tags": ["a"]}, "rest": {"x": {"n": 2}}, "ids": [3, 3], "ratio": 2}
    got = from_jsonable(Outer, data, "item")
    assert got == Outer(Inner(1, ("a",)), None, {"x": Inner(2)}, {3}, 2.0)
    assert to_jsonable((got.inner, [got.maybe])) == [{"n": 1, "tags": ["a"]}, [None]]
    with pytest.raises(ValueError, match="expected a JSON object for Inner"):
        from_jsonable(Outer, {"inner": [1], "maybe": None}, "item")
    with pytest.raises(ValueError, match="missing required field 'inner'"):
        from_jsonable(Outer, {"maybe": None}, "item")
    with pytest.raises(ValueError, match="cannot build int"):
        from_jsonable(int, "seven", "item.step")


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


def test_merge_corners() -> None:
    target: dict[str, Any] = {"s": {1}, "p": Pair(torch.zeros(1), 0), "d": collections.deque([0, 0])}
    source = {"s": {2, 3}, "p": [torch.ones(1), 5], "d": collections.deque([7, 8, 9])}
    keep = target["p"].a
    merged, missing = walk_checkpoint_structure(item_key="x", source=source, target=target)
    assert merged["s"] == {2, 3} and merged["d"] == collections.deque([7, 8, 9])  # extra entries are kept
    assert (
        isinstance(merged["p"], Pair)
        and merged["p"].a is keep
        and torch.equal(keep, torch.ones(1))
        and merged["p"].b == 5
    )
    assert missing == []
    with pytest.raises(RuntimeError, match="set to set, but source value is list"):
        walk_checkpoint_structure(item_key="x", source=[1], target={1})
    with pytest.raises(RuntimeError, match="set to deque, but source value is list.*a deque is saved and loaded"):
        walk_checkpoint_structure(item_key="x", source=[7, 8, 9], target=collections.deque([0, 0]))
    with pytest.raises(RuntimeError, match="set to Tensor, but source value is int"):
        walk_checkpoint_structure(item_key="x", source=1, target=torch.zeros(1))
    seen: list[str] = []
    walk_checkpoint_structure(
        item_key="x",
        source={"t": torch.ones(1), "n": 2},
        target={"t": torch.zeros(1), "n": 0},
        leaf_fn=lambda path, src, tgt: seen.append(str(path)),
    )
    assert seen == ["x::t", "x::n"]


def test_pinned_memory_request_on_cpu_warns_and_stages_plainly() -> None:
    if torch.cuda.is_available():
        pytest.skip("the warning is for machines without CUDA")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stager = DefaultStager(CheckpointStagerConfig(use_pinned_memory=True))
    assert any("CUDA is not available" in str(w.message) for w in caught)
    staged = stager.stage({"m": {"w": torch.arange(4.0)}})
    assert torch.equal(staged["m"]["w"], torch.arange(4.0)) and stager.pinned_num_bytes() == 0
    stager.close()


def test_local_storage_corners(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a LocalFileSystemStorageConfig"):
        LocalFileSystemStorage(None)
    storage = LocalFileSystemStorage(STORAGE)
    with pytest.raises(RuntimeError, match="Parent directory does not exist"):
        storage.write(tmp_path / "no" / "such" / "f", b"x")
    storage.mkdir(tmp_path / "d", recursive=False)
    storage.mkdir(tmp_path / "d", recursive=False)  # idempotent
    storage.write(tmp_path / "d" / "f", b"abc")
    storage.rename(tmp_path / "d", tmp_path / "e", is_directory=True, is_cross_link=True)
    assert storage.read(tmp_path / "e" / "f") == b"abc" and storage.read_range(tmp_path / "e" / "f", 1, 5) == b"bc"
    storage.rmdir(tmp_path / "e")  # not empty: removed with its content
    assert not storage.exists(tmp_path / "e")


def test_layout_paths_are_normalised_before_collision_checks() -> None:
    items = {
        "a": ItemSpec(layout=LayoutInfo("./x.pt", TorchSerialization())),
        "b": ItemSpec(layout=LayoutInfo("x.pt", TorchSerialization())),
    }
    with pytest.raises(ValueError, match="'a' and 'b' both resolve to the file 'x.pt'"):
        resolve({"a": 1, "b": 2}, items, None, 0)


@pytest.mark.parametrize(("outer", "inner"), [("d", "d/x.pt"), ("d/e", "d/e/f/x.pt"), ("./d", "d/x.pt")])
def test_a_layout_inside_another_items_file_is_refused_naming_both(outer: str, inner: str) -> None:
    """'d' and 'd/x.pt' cannot both be files: refused at planning (an IsADirectoryError from the writer before)."""
    items = {
        "a": ItemSpec(layout=LayoutInfo(outer, TorchSerialization())),
        "b": ItemSpec(layout=LayoutInfo(inner, TorchSerialization())),
    }
    for order in (("a", "b"), ("b", "a")):
        with pytest.raises(ValueError, match=r"Item 'b' is written to .*the file of item 'a' on rank 0"):
            resolve(dict.fromkeys(order, 1), items, None, 0)


@pytest.mark.parametrize(
    "items",
    [{}, {"a": ItemSpec(layout=LayoutInfo("sub/" + "n" * 256 + ".pt", TorchSerialization()))}],
    ids=["long-key-default-layout", "long-layout-name"],
)
def test_a_file_name_over_name_max_is_refused_at_planning(items: dict[str, ItemSpec]) -> None:
    """A 300-character key (or a layout name over 255 bytes) failed in the writer with ENAMETOOLONG."""
    key = "a" if items else "k" * 300
    with pytest.raises(ValueError, match=r"file name of \d+ bytes .*over the 255-byte limit"):
        resolve({key: 1}, items, ItemSpec(), 0)
