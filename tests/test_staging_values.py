"""Values the staging copy, the tree walks and the merge got wrong: each test failed before its fix.

A value that contains itself hung a Torch save with memory growing; an async save untied tied tensors and wrote a
slice without its base storage while a sync save wrote the whole base; deep nesting, sub-byte dtypes and a stored
meta tensor failed with bare torch/Python errors. Each is now one rule for both save modes, or a refusal naming
the item and path.
"""

from __future__ import annotations

import pickle
import resource
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.staging import DefaultStager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.traversal import NestingError, iter_leaves, leaves, map_leaves
from torch_checkpointing.types import CheckpointPath
from torch_checkpointing.walk_utils import check_tensor_fits, walk_checkpoint_structure

REPO = Path(__file__).resolve().parents[1]


def _manager(async_save: bool, **items: ItemSpec) -> CheckpointManager:
    config = CheckpointManager.Config.with_async_save() if async_save else CheckpointManager.Config.with_sync_save()
    config.items = items
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(config)


@pytest.fixture(scope="module")
def managers() -> Iterator[dict[bool, CheckpointManager]]:
    """A sync and an async manager (the async writer process starts once for the module)."""
    built = {mode: _manager(mode) for mode in (False, True)}
    yield built
    for manager in built.values():
        manager.close()


def _save(manager: CheckpointManager, path: Path, state: dict[str, Any]) -> None:
    future = manager.save(str(path), state)
    if future is not None:
        future.result(timeout=120)


def _looped() -> dict[str, Any]:
    loop: dict[str, Any] = {"a": 1}
    loop["self"] = loop
    return {"x": [0, loop]}


# 1. a value that contains itself


@pytest.mark.parametrize("walk", ["leaves", "iter_leaves", "map_leaves"])
def test_every_walk_refuses_a_cycle_naming_its_path(walk: str) -> None:
    run = {
        "leaves": lambda v: list(leaves(v)),
        "iter_leaves": lambda v: list(iter_leaves(v)),
        "map_leaves": lambda v: map_leaves(v, lambda x: x),
    }[walk]
    with pytest.raises(NestingError, match=r"'x\.1\.self' contains itself") as info:
        run(_looped())
    assert info.value.path == ("x", 1, "self") and info.value.cycle
    assert "'item::x.1.self'" in str(info.value.for_item("item"))


def test_a_shared_subtree_is_not_a_cycle() -> None:
    shared = {"p": [1, 2]}
    value = {"a": shared, "b": [shared, shared]}
    assert list(leaves(value)) == [1, 2] * 3
    assert [p for p, _ in iter_leaves(value)][-1] == ("b", 1, "p", 1)
    assert map_leaves(value, lambda x: x * 10) == {"a": {"p": [10, 20]}, "b": [{"p": [10, 20]}] * 2}


def test_a_sync_torch_save_of_a_value_containing_itself_is_refused_not_hung(tmp_path: Path) -> None:
    """A real process under a memory cap and a timeout: the old walk looped forever, growing its stack."""
    script = textwrap.dedent(
        f"""
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        if __name__ == "__main__":
            config = CheckpointManager.Config.with_sync_save()
            config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
            manager = CheckpointManager(config)
            loop = {{"a": 1}}
            loop["self"] = loop
            try:
                manager.save({str(tmp_path / "ck")!r}, {{"item": loop}})
            except ValueError as exc:
                print("REFUSED", exc)
            manager.close()
        """
    )

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    try:
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, preexec_fn=cap
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the save of a value that contains itself hung")
    assert "REFUSED" in done.stdout, done.stderr[-2000:]
    assert "'item::self' contains itself" in done.stdout
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").rglob("manifest.json"))


def test_the_async_stager_refuses_a_cycle_naming_the_item() -> None:
    stager = DefaultStager()
    try:
        with pytest.raises(NestingError, match=r"'item::x\.1\.self' contains itself"):
            stager.stage({"item": {"t": torch.ones(2), **_looped()}})
    finally:
        stager.close()


def test_the_merge_refuses_a_source_and_template_that_contain_themselves() -> None:
    source, template = _looped(), _looped()
    with pytest.raises(NestingError, match=r"'item::x\.1\.self' contains itself"):
        walk_checkpoint_structure(item_key="item", source=source, target=template, dry_run=True)


# 2. one storage rule for sync and async saves


def _state() -> dict[str, Any]:
    w, big = torch.arange(3.0), torch.arange(1e6)
    return {"item": {"emb": w, "head": w, "head_view": w.detach(), "v": big[10:12], "t": big[:6].view(2, 3).t()}}


def test_sync_and_async_torch_saves_write_one_file_with_ties_kept_and_slices_compacted(
    managers: dict[bool, CheckpointManager], tmp_path: Path
) -> None:
    sizes = {}
    for mode, manager in managers.items():
        _save(manager, tmp_path / f"ck_{mode}", _state())
        item = manager.load(str(tmp_path / f"ck_{mode}"))["item"]
        ptr = item["emb"].untyped_storage().data_ptr()
        assert item["head"].untyped_storage().data_ptr() == ptr, f"async={mode}: tied tensors came back untied"
        assert item["head_view"].untyped_storage().data_ptr() == ptr
        assert item["v"].untyped_storage().nbytes() == 8, f"async={mode}: the slice was written with its base"
        assert torch.equal(item["v"], torch.tensor([10.0, 11.0]))
        assert torch.equal(item["t"], torch.arange(6.0).view(2, 3).t())
        assert item["t"].untyped_storage().nbytes() == 24
        sizes[mode] = sum(f.stat().st_size for f in (tmp_path / f"ck_{mode}").rglob("*.pt"))
    assert sizes[False] == sizes[True] < 10_000


def test_safetensors_saves_write_each_tensor_alone_in_both_modes(tmp_path: Path) -> None:
    """safetensors files hold no aliasing: tied tensors load back as equal, independent tensors either way."""
    spec = ItemSpec(layout=LayoutInfo("item.safetensors", SafetensorsSerialization()))
    for mode in (False, True):
        manager = _manager(mode, item=spec)
        try:
            _save(manager, tmp_path / f"st_{mode}", _state())
            item = manager.load(str(tmp_path / f"st_{mode}"))["item"]
        finally:
            manager.close()
        assert torch.equal(item["emb"], item["head"]) and torch.equal(item["v"], torch.tensor([10.0, 11.0]))
        item["emb"].add_(1)
        assert not torch.equal(item["emb"], item["head"])
        assert (tmp_path / f"st_{mode}" / "item.safetensors").stat().st_size < 10_000


def test_the_stager_copies_a_tied_tensor_once() -> None:
    w = torch.arange(4.0)
    stager = DefaultStager()
    try:
        staged = stager.stage({"item": {"a": w, "b": w, "c": w.detach(), "d": w[1:3]}})["item"]
        assert staged["a"] is staged["b"] is staged["c"]
        assert stager.slab is not None and stager.slab.numel() == 128  # two 64-byte-aligned slots, not four
        assert torch.equal(staged["d"], w[1:3])
    finally:
        stager.close()


# 3. nesting deeper than a recursive walk can descend


def _deep(levels: int) -> dict[str, Any]:
    root = node = {}
    for _ in range(levels):
        node["a"] = {}
        node = node["a"]
    node["t"] = torch.ones(1)
    return root


def test_the_async_stager_refuses_deep_nesting_naming_the_item() -> None:
    stager = DefaultStager()
    try:
        with pytest.raises(NestingError, match=r"Item 'item' is nested deeper than Python's recursion limit"):
            stager.stage({"item": _deep(sys.getrecursionlimit() + 100)})
    finally:
        stager.close()


def test_leaves_walks_any_depth() -> None:
    assert len(list(leaves(_deep(5000)))) == 1


# 4. sub-byte dtypes


@pytest.mark.parametrize("dtype", ["uint1", "uint7", "int3"])
def test_the_async_stager_refuses_sub_byte_dtypes_before_copying(dtype: str) -> None:
    if not hasattr(torch, dtype):
        pytest.skip(f"this torch has no torch.{dtype}")
    bits = getattr(torch, dtype)
    stager = DefaultStager()
    try:
        with pytest.raises(pickle.PicklingError, match=rf"'item::m\.x' is a tensor of dtype torch\.{dtype}"):
            stager.stage({"item": {"m": {"w": torch.ones(4), "x": torch.empty(8, dtype=bits)}}})
        assert stager.slab is None  # refused before the slab was even allocated
    finally:
        stager.close()


# 5. a stored meta tensor loaded into a real template


def test_a_stored_meta_tensor_is_refused_in_the_check_phase_naming_the_key() -> None:
    where = CheckpointPath("item", ("w",))
    with pytest.raises(CorruptCheckpointError, match=r"meta tensor at .*w"):
        check_tensor_fits(where, torch.empty(3, device="meta"), torch.zeros(3))
    template = {"w": torch.zeros(3)}
    with pytest.raises(CorruptCheckpointError, match="meta tensor"):
        walk_checkpoint_structure(item_key="item", source={"w": torch.empty(3, device="meta")}, target=template)
    assert torch.equal(template["w"], torch.zeros(3))
