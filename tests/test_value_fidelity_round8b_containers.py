"""A container of another type than dict/list/tuple loads back as that type, with its attributes, whichever
path the save takes; one that cannot be rebuilt becomes a dict or list with a log line naming its path.

Each test here failed before its fix: `traversal.rebuild` (the staging copy of every async save, and of a sync
save holding a tensor that needs its written form) built such a container as `type(original)(items)`, and
fell back to a plain dict or list, silently, for any type that constructor does not take: a `defaultdict`
lost its `default_factory` and became a `dict`, a dict or list subclass lost its attributes, a torch
`return_types` value became a list. A plain sync save pickled the value as it is, so the checkpoint's content
depended on the save mode.
"""

from __future__ import annotations

import collections
import logging
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from tests.test_value_fidelity import manager_for
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.traversal import map_leaves


class Point(NamedTuple):
    x: Any
    y: Any


class Tagged(dict):  # type: ignore[type-arg]
    """A dict subclass whose constructor does not take its items, with an attribute of its own."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag


class Rows(list):  # type: ignore[type-arg]
    def __init__(self, label: str, rows: list[Any] | None = None) -> None:
        super().__init__(rows or [])
        self.label = label


class Frozen(Mapping[str, Any]):
    """An immutable Mapping only its keyword constructor builds: rebuilt as a dict, which is said."""

    def __init__(self, **kw: Any) -> None:
        self._d = dict(kw)

    def __getitem__(self, k: str) -> Any:
        return self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def _tagged() -> Tagged:
    t = Tagged("best")
    t["w"] = torch.ones(2)
    return t


def _values() -> dict[str, Any]:
    return {
        "counts": defaultdict(int, {"x": 1, "t": torch.arange(3)}),
        "nested": defaultdict(list, {"a": [torch.zeros(2)]}),
        "ordered": OrderedDict([("b", torch.ones(1)), ("a", 2)]),
        "point": Point(torch.ones(2), 3),
        "counter": collections.Counter({"k": 4}),
        "tagged": _tagged(),
        "rows": Rows("r", [torch.ones(1), 5]),
        "max": torch.max(torch.arange(4.0).reshape(2, 2), 0),
    }


def _manager(async_save: bool) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items={"cfg": ItemSpec(layout=LayoutInfo("cfg_{rank}.bin", TorchSerialization()))},
            save=AsyncCheckpointSaverConfig() if async_save else SyncCheckpointSaverConfig(),
            load=CheckpointLoaderConfig(weights_only=False),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} came back as {type(b).__name__}"
    assert getattr(a, "__dict__", None) == getattr(b, "__dict__", None), f"{where}: attributes differ"
    if isinstance(a, defaultdict):
        assert a.default_factory is b.default_factory, f"{where}: default_factory"
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, Mapping):
        assert list(a) == list(b), f"{where}: keys"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, where


@pytest.mark.parametrize("mode", ["sync", "sync_strided", "async"])
def test_containers_of_other_types_round_trip_identically_in_every_save_mode(mode: str, tmp_path: Path) -> None:
    value = _values()
    if mode == "sync_strided":  # a non-contiguous view needs its written form: the staging path of a sync save
        value["view"] = torch.arange(6.0).reshape(2, 3).t()
    with _manager(async_save=mode == "async") as manager:
        write = manager.save(str(tmp_path / "ck"), {"cfg": value})
        if write is not None:
            write.result(timeout=120)
        loaded = manager.load(str(tmp_path / "ck"))["cfg"]
    _assert_same(value, loaded)


def test_the_staging_walk_keeps_the_type_and_attributes_of_every_container() -> None:
    value = _values()
    _assert_same(value, map_leaves(value, lambda leaf: leaf))


def test_a_container_that_cannot_be_rebuilt_becomes_a_dict_with_a_log_line_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    value = {"a": [1, {"frozen": Frozen(w=torch.ones(1))}]}
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        out = map_leaves(value, lambda leaf: leaf)
    assert type(out["a"][1]["frozen"]) is dict
    said = [r.getMessage() for r in caplog.records if r.name.startswith("torch_checkpointing")]
    assert any("a.1.frozen" in m and "Frozen" in m for m in said), said


def test_the_rebuilt_mapping_is_a_new_object_and_the_original_is_unchanged() -> None:
    original = defaultdict(int, {"x": torch.ones(1)})
    out = map_leaves(original, lambda leaf: leaf * 2)
    assert (
        out is not original and torch.equal(original["x"], torch.ones(1)) and torch.equal(out["x"], 2 * torch.ones(1))
    )


def test_the_torch_format_stays_the_reference_for_a_plain_sync_save(tmp_path: Path) -> None:
    """The neighbour: a plain sync save (no staging) already kept every type; it must go on doing so."""
    value = {"counts": defaultdict(int, {"x": 1})}
    with manager_for(TorchSerialization()) as manager, pytest.warns(UserWarning, match="collections.defaultdict"):
        manager.save(str(tmp_path / "ck"), {"cfg": value})  # warned: its default load refuses a defaultdict
    with _manager(async_save=False) as manager:
        loaded = manager.load(str(tmp_path / "ck"))["cfg"]
    _assert_same(value, loaded)


class Labelled(tuple):  # type: ignore[type-arg]
    """A tuple subclass with an attribute of its own."""


def test_a_tuple_subclass_keeps_its_attributes_and_a_mapping_its_new_items() -> None:
    from tests.container_types import Frozen

    row = Labelled((torch.ones(1), 2))
    row.label = "r"  # type: ignore[attr-defined]
    out = map_leaves({"row": row, "frozen": Frozen({"w": 1})}, lambda leaf: leaf * 3)
    assert type(out["row"]) is Labelled and out["row"].label == "r" and out["row"][1] == 6
    assert type(out["frozen"]) is Frozen and out["frozen"]["w"] == 3  # the constructor's items, not the original's
