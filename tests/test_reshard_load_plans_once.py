"""A resharding load plans each item once, in its check phase, and copies exactly that plan.

One load needs an item's plan three times: the files to verify, the check phase (every planned block checked
against the manifest's block CRCs before any copy) and the copy phase. It is planned once and handed on; no
module-level memo of earlier answers keeps metadata alive or answers from a stale entry.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_reshard_plans import make_md
from tests.test_verified_loads import WholeFileResharder
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing import dtensor_resharder as dr
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import DistributedItemMetadata, GlobalObjectMetadata
from torch_checkpointing.dtensor_metadata import ReplicateSpec, ShardSpec
from torch_checkpointing.dtensor_resharder import DTensorResharder, plan_resharding
from torch_checkpointing.resharding import Resharder
from torch_checkpointing.source_reader import SourceTensor
from torch_checkpointing.storage.base_storage import Storage

FORMATS = ["torch", "safetensors"]


def _layout(key: str, fmt: str) -> LayoutInfo | None:
    return LayoutInfo(f"{key}_{{rank}}.safetensors", SafetensorsSerialization()) if fmt == "safetensors" else None


class AlwaysReshard(DTensorResharder):
    """Reshards even at an unchanged layout: the resharded load path on one process."""

    def should_reshard(self, source_metadata: DistributedItemMetadata | None, target_metadata: Any) -> bool:
        return source_metadata is not None and target_metadata is not None


class LoggingLoad(AlwaysReshard):
    """A user subclass overriding `load`: the loader must still call it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: Any,
        source_metadata: DistributedItemMetadata,
        target: Any,
        storage: Storage,
    ) -> list[Any]:
        self.calls.append((source_path, item_key, target_metadata, source_metadata, target, storage))
        return super().load(source_path, item_key, target_metadata, source_metadata, target, storage)


class RankOverride(AlwaysReshard):
    """A user subclass overriding `load_as_rank`, which `DTensorResharder.load` delegates to."""

    def __init__(self) -> None:
        super().__init__()
        self.ranks: list[int] = []

    def load_as_rank(self, rank: int, *args: Any) -> list[Any]:
        self.ranks.append(rank)
        return super().load_as_rank(rank, *args)


class CopyAll(WholeFileResharder):
    """A custom resharder (not a DTensorResharder): its `load` gets the public arguments and nothing planned."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def load(
        self, source_path: Path, item_key: str, target_metadata: Any, source_metadata: Any, target: Any, storage: Any
    ) -> list[Any]:
        self.calls.append((source_path, item_key, target_metadata, source_metadata, target, storage))
        return super().load(source_path, item_key, target_metadata, source_metadata, target, storage)


def _values() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "model": {"w": torch.arange(4096, dtype=torch.float32), "b": torch.arange(8, dtype=torch.float32)},
        "optim": {"m": torch.arange(300, dtype=torch.float32).reshape(30, 10)},
    }


def _zeros() -> dict[str, dict[str, torch.Tensor]]:
    return {key: {k: torch.zeros_like(v) for k, v in value.items()} for key, value in _values().items()}


def _manager(resharders: dict[str, Resharder], fmt: str) -> CheckpointManager:
    items = {key: ItemSpec(resharder=r, layout=_layout(key, fmt)) for key, r in resharders.items()}
    return CheckpointManager(
        CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
    )


def _save(root: Path, fmt: str = "torch") -> None:
    m = _manager({"model": AlwaysReshard(), "optim": AlwaysReshard()}, fmt)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            m.save(str(root), _values())
    finally:
        m.close()


def _load(root: Path, resharders: dict[str, Resharder], fmt: str = "torch") -> dict[str, Any]:
    targets = {key: _zeros()[key] for key in resharders}
    m = _manager(resharders, fmt)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            m.load(str(root), into=targets, strict=True)
    finally:
        m.close()
    return targets


def _with_subclasses(cls: type) -> list[type]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _with_subclasses(direct))]


def _assert_restored(targets: dict[str, Any]) -> None:
    values = _values()
    for key, value in targets.items():
        for name, tensor in value.items():
            assert torch.equal(tensor, values[key][name]), f"{key}::{name}"


@pytest.fixture
def plan_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[DistributedItemMetadata]]:
    """Every `plan_resharding` call made while the test runs, as the source metadata it planned from."""
    calls: list[DistributedItemMetadata] = []
    real = dr.plan_resharding

    def counting(target_metadata: Any, source_metadata: DistributedItemMetadata, *args: Any) -> Any:
        calls.append(source_metadata)
        return real(target_metadata, source_metadata, *args)

    monkeypatch.setattr(dr, "plan_resharding", counting)
    yield calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_resharding_load_plans_each_item_once(
    tmp_path: Path, fmt: str, plan_calls: list[DistributedItemMetadata]
) -> None:
    _save(tmp_path / "ck", fmt)
    targets = _load(tmp_path / "ck", {"model": AlwaysReshard(), "optim": AlwaysReshard()}, fmt)
    _assert_restored(targets)
    assert len(plan_calls) == 2, f"{len(plan_calls)} plans for 2 items"
    assert plan_calls[0] is not plan_calls[1]  # one per item, not one item twice


def test_the_copy_phase_reads_exactly_the_blocks_the_check_phase_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path / "ck")
    checked: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    read: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real_read = SourceTensor.read_block

    def checking(real: Any) -> Any:
        def check(self: SourceTensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
            if not read:  # the check phase; a read may check its block again
                checked.append((tuple(offsets), tuple(sizes)))
            real(self, offsets, sizes)

        return check

    def read_block(self: SourceTensor, offsets: tuple[int, ...], sizes: tuple[int, ...], stats: Any) -> Any:
        read.append((tuple(offsets), tuple(sizes)))
        return real_read(self, offsets, sizes, stats)

    for cls in _with_subclasses(SourceTensor):
        if "check_block" in vars(cls):
            monkeypatch.setattr(cls, "check_block", checking(vars(cls)["check_block"]))
    monkeypatch.setattr(SourceTensor, "read_block", read_block)
    _assert_restored(_load(tmp_path / "ck", {"model": AlwaysReshard(), "optim": AlwaysReshard()}))
    assert read and sorted(read) == sorted(checked)


def test_a_subclass_overriding_load_still_has_its_load_called(tmp_path: Path) -> None:
    _save(tmp_path / "ck")
    resharder = LoggingLoad()
    targets = _load(tmp_path / "ck", {"model": resharder})
    _assert_restored(targets)
    assert len(resharder.calls) == 1
    source_path, key, target_md, source_md, target, storage = resharder.calls[0]
    assert (Path(source_path), key, target) == (tmp_path / "ck", "model", targets["model"])
    assert set(target_md) == {("w",), ("b",)} and isinstance(source_md, DistributedItemMetadata)
    assert isinstance(storage, Storage)


def test_a_subclass_overriding_load_as_rank_still_has_it_called(tmp_path: Path) -> None:
    _save(tmp_path / "ck")
    resharder = RankOverride()
    _assert_restored(_load(tmp_path / "ck", {"model": resharder}))
    assert resharder.ranks == [0]


def test_a_custom_resharder_gets_load_called_with_the_public_arguments(
    tmp_path: Path, plan_calls: list[DistributedItemMetadata]
) -> None:
    _save(tmp_path / "ck")
    resharder = CopyAll()
    targets = _load(tmp_path / "ck", {"model": resharder})
    assert torch.equal(targets["model"]["w"], _values()["model"]["w"])
    assert len(resharder.calls) == 1
    source_path, key, target_md, source_md, target, storage = resharder.calls[0]
    assert (Path(source_path), key, target) == (tmp_path / "ck", "model", targets["model"])
    assert set(target_md) == {("w",), ("b",)} and isinstance(source_md, DistributedItemMetadata)
    assert isinstance(storage, Storage)
    assert plan_calls == []  # the DTensor planner is not the custom resharder's business


def test_a_load_keeps_no_metadata_alive_once_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 10k-rank job's metadata is large: nothing may hold it once the load that read it has returned.
    _save(tmp_path / "ck")
    refs: list[weakref.ref[Any]] = []
    real = dr.plan_resharding

    def tracking(target_metadata: Any, source_metadata: DistributedItemMetadata, *args: Any) -> Any:
        refs.append(weakref.ref(source_metadata))
        return real(target_metadata, source_metadata, *args)

    monkeypatch.setattr(dr, "plan_resharding", tracking)
    _assert_restored(_load(tmp_path / "ck", {"model": AlwaysReshard(), "optim": AlwaysReshard()}))
    gc.collect()
    assert refs and [r() for r in refs] == [None] * len(refs)


def test_plan_resharding_answers_afresh_for_each_call() -> None:
    # The planner keeps nothing between calls: the answer follows the metadata it is given, and the source
    # metadata it was given is not kept alive after it returns.
    saved = make_md((8,), torch.float32, ((2,), (0, 1), (ShardSpec(0),)))
    whole = make_md((8,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    source = DistributedItemMetadata({("w",): [GlobalObjectMetadata(saved, (0, 1))]}, {0: None, 1: None})
    target: dict[Any, Any] = {("w",): whole}
    first = plan_resharding(target, source, 0)
    assert [p.src_rank for p in first.nested_path_to_load_plans[("w",)]] == [0, 1]
    first.nested_path_to_load_plans[("w",)].clear()  # a caller's edit reaches no later answer
    assert len(plan_resharding(target, source, 0).nested_path_to_load_plans[("w",)]) == 2
    ref = weakref.ref(source)
    del source
    gc.collect()
    assert ref() is None
