"""One container rule for save and load: the merge into `into=` templates descends into exactly what the save
walks (any Mapping, list and tuple, named tuples included) and takes every other value as one leaf.

Before, the merge descended into any `Sequence` (a `UserList`, a `deque`, a `range`, an `array`, a custom
Sequence): it crashed with a bare TypeError (deque, range), silently rebuilt a custom Sequence wrongly, reported
paths inside a value the save stored whole, and merged a saved list into a non-list template. Every test here
saves and loads through the public API except the first, which checks the two walks against each other.
"""

from __future__ import annotations

import array
import collections
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch

from tests.container_types import Frozen, KeywordMap, Pair
from torch_checkpointing import CheckpointManager, DTensorResharder, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    SafetensorsSerialization,
    SerializationFormat,
    TorchSerialization,
)
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import TemplateMismatchError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.traversal import is_container, iter_leaves, local_tensor
from torch_checkpointing.types import CheckpointPath
from torch_checkpointing.walk_utils import walk_checkpoint_structure


class Seq(Sequence[Any]):
    """A custom immutable Sequence whose constructor takes the items one by one (not an iterable)."""

    def __init__(self, *items: Any) -> None:
        self._items = list(items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


class Text(str):
    pass


Fill = Callable[[int], Any]
# name -> build(fill): the same shape with `fill(i)` at every position, so a template and a value share a type.
CONTAINERS: dict[str, Callable[[Fill], Any]] = {
    "list": lambda f: [f(1), f(2)],
    "tuple": lambda f: (f(1), f(2)),
    "namedtuple": lambda f: Pair(f(1), f(2)),
    "OrderedDict": lambda f: collections.OrderedDict(a=f(1), b=f(2)),
    "UserDict": lambda f: collections.UserDict(a=f(1), b=f(2)),
    "Frozen": lambda f: Frozen({"a": f(1), "b": f(2)}),
    "KeywordMap": lambda f: KeywordMap(a=f(1), b=f(2)),
}
LEAVES: dict[str, Callable[[Fill], Any]] = {
    "UserList": lambda f: collections.UserList([f(1), f(2)]),
    "deque": lambda f: collections.deque([f(1), f(2)]),
    "Seq": lambda f: Seq(f(1), f(2)),
    "range": lambda f: range(1, 3),
    "array": lambda f: array.array("i", [1, 2]),
    "set": lambda f: {1, 2},
    "frozenset": lambda f: frozenset({1, 2}),
    "bytearray": lambda f: bytearray(b"12"),
    "Text": lambda f: Text("12"),
}


def _tensor(i: int) -> torch.Tensor:
    return torch.full((2,), float(i))


def _zeros(i: int) -> torch.Tensor:
    return torch.zeros(2)


def _returned_type(template: Any) -> type:
    """The type a merged container comes back as: its own, or a dict where it cannot be built from its items."""
    return dict if isinstance(template, KeywordMap) else type(template)


def _same(actual: Any, expected: Any) -> bool:
    """Equal leaves at equal paths under traversal's walk, each of the expected type; tensors (also inside a
    sequence leaf) compared by value and dtype."""
    a, e = list(iter_leaves(actual)), list(iter_leaves(expected))
    return [p for p, _ in a] == [p for p, _ in e] and all(_equal(x, y) for (_, x), (_, y) in zip(a, e, strict=True))


def _equal(x: Any, y: Any) -> bool:
    if isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and x.dtype == y.dtype and torch.equal(local_tensor(x), local_tensor(y))
    if type(x) is not type(y):
        return False
    if isinstance(y, (collections.UserList, collections.deque, Seq)):
        return len(x) == len(y) and all(_equal(i, j) for i, j in zip(x, y, strict=True))
    return bool(x == y)


def _manager(fmt: SerializationFormat | None = None, *, trusting: bool = False, **item: Any) -> CheckpointManager:
    spec = ItemSpec(layout=LayoutInfo("item.bin", fmt), **item) if fmt is not None else ItemSpec(**item)
    return CheckpointManager(
        CheckpointManager.Config(
            items={"item": spec},
            save=SyncCheckpointSaverConfig(),
            load=CheckpointLoaderConfig(weights_only=not trusting),
        )
    )


@pytest.fixture
def trusting() -> Iterator[CheckpointManager]:
    """Torch files with user classes in them need the trusting loader; the rule under test is the same."""
    manager = _manager(TorchSerialization(), trusting=True)
    yield manager
    manager.close()


# ------------------------------------------------------------------------------ the two walks, side by side


def _every_type(fill: Fill) -> dict[str, Any]:
    return {name: build(fill) for name, build in {**CONTAINERS, **LEAVES}.items()}


def test_the_merge_visits_exactly_the_leaves_the_save_walks() -> None:
    template, source = _every_type(_zeros), _every_type(_tensor)
    visited: list[tuple[Any, ...]] = []

    def leaf(where: CheckpointPath, value: Any, target: Any) -> Any:
        visited.append(where.nested_path)
        return value

    walk_checkpoint_structure(item_key="k", source=source, target=template, leaf_fn=leaf)
    assert visited == [path for path, _ in iter_leaves(template)]


# ------------------------------------------------------------------------------------ torch files, every type


@pytest.mark.parametrize("name", list(CONTAINERS))
def test_torch_containers_are_merged_entry_by_entry(trusting: CheckpointManager, tmp_path: Path, name: str) -> None:
    build = CONTAINERS[name]
    trusting.save(str(tmp_path / "c"), {"item": {"x": build(_tensor)}})
    template = build(_zeros)
    out = trusting.load(str(tmp_path / "c"), into={"item": {"x": template}}, strict=True)["item"]["x"]
    assert type(out) is _returned_type(template) and _same(out, build(_tensor))
    for (_, got), (_, mine) in zip(iter_leaves(out), iter_leaves(template), strict=True):
        assert got is mine  # the template's tensors, filled in place
    if isinstance(template, (list, collections.OrderedDict, collections.UserDict)):
        assert out is template


@pytest.mark.parametrize("name", list(LEAVES))
def test_torch_leaves_are_replaced_whole_by_the_stored_value(
    trusting: CheckpointManager, tmp_path: Path, name: str
) -> None:
    build = LEAVES[name]
    trusting.save(str(tmp_path / "c"), {"item": {"x": build(_tensor)}})
    template = build(_zeros)
    out = trusting.load(str(tmp_path / "c"), into={"item": {"x": template}}, strict=True)["item"]["x"]
    assert out is not template and type(out) is type(template) and _same(out, build(_tensor))
    if name in ("UserList", "deque", "Seq"):
        assert all(torch.equal(t, torch.zeros(2)) for t in template)  # the template is not written into


# Two templates per sequence leaf: empty, and longer than the saved value.
_OTHER_LENGTHS: dict[str, tuple[Any, Any]] = {
    "UserList": (collections.UserList(), collections.UserList([_zeros(0)] * 3)),
    "deque": (collections.deque(), collections.deque([_zeros(0)] * 3)),
    "Seq": (Seq(), Seq(_zeros(0), _zeros(0), _zeros(0))),
    "array": (array.array("i"), array.array("i", [0, 0, 0])),
}


@pytest.mark.parametrize("name", list(_OTHER_LENGTHS))
def test_a_leaf_of_another_length_reports_no_path_inside_it(
    trusting: CheckpointManager, tmp_path: Path, name: str
) -> None:
    # The save stored the value whole, so there is no `x.2` to be missing, nor an `x.1` to be unexpected.
    saved = LEAVES[name](_tensor)
    trusting.save(str(tmp_path / "c"), {"item": {"x": saved}})
    for template in _OTHER_LENGTHS[name]:
        out = trusting.load(str(tmp_path / "c"), into={"item": {"x": template}}, strict=True)["item"]["x"]
        assert type(out) is type(saved) and _same(out, saved)


# ------------------------------------------------------------------------------ a container against a leaf


@pytest.mark.parametrize(
    ("saved", "template", "leaf"),
    [
        ([_tensor(1)], collections.UserList([_zeros(1)]), "UserList"),
        (collections.UserList([_tensor(1)]), [_zeros(1)], "UserList"),
        (collections.deque([_tensor(1)]), (_zeros(1),), "deque"),
        ({"a": _tensor(1)}, collections.deque([_zeros(1)]), "deque"),
    ],
    ids=["list-into-UserList", "UserList-into-list", "deque-into-tuple", "dict-into-deque"],
)
def test_a_container_and_a_leaf_do_not_merge(
    trusting: CheckpointManager, tmp_path: Path, saved: Any, template: Any, leaf: str
) -> None:
    trusting.save(str(tmp_path / "c"), {"item": {"w": _tensor(5), "x": saved}})
    w = torch.zeros(2)
    with pytest.raises(TemplateMismatchError, match=rf"nested_path=\('x',\).*'item'.*a {leaf} is saved and loaded"):
        trusting.load(str(tmp_path / "c"), into={"item": {"w": w, "x": template}})
    assert torch.equal(w, torch.zeros(2))  # refused in the check phase: nothing was copied


# ----------------------------------------------------------------------------------------- JSON and safetensors


_JSON_CONTAINERS = {**CONTAINERS, "MappingProxy": lambda f: MappingProxyType({"a": f(1), "b": f(2)})}


@pytest.mark.parametrize("name", list(_JSON_CONTAINERS))
def test_json_containers_come_back_as_the_template_type(tmp_path: Path, name: str) -> None:
    build = _JSON_CONTAINERS[name]
    manager = _manager(JsonSerialization())
    try:
        manager.save(str(tmp_path / "c"), {"item": {"x": build(lambda i: i)}})
        template = build(lambda i: 0)
        out = manager.load(str(tmp_path / "c"), into={"item": {"x": template}}, strict=True)["item"]["x"]
        assert type(out) is _returned_type(template) and _same(out, build(lambda i: i))
    finally:
        manager.close()


@pytest.mark.parametrize("name", list(_JSON_CONTAINERS))
def test_safetensors_containers_come_back_as_the_template_type(tmp_path: Path, name: str) -> None:
    build = _JSON_CONTAINERS[name]
    manager = _manager(SafetensorsSerialization())
    try:
        manager.save(str(tmp_path / "c"), {"item": {"x": build(_tensor)}})
        template = build(_zeros)
        out = manager.load(str(tmp_path / "c"), into={"item": {"x": template}}, strict=True)["item"]["x"]
        assert type(out) is _returned_type(template) and _same(out, build(_tensor))
        for (_, got), (_, mine) in zip(iter_leaves(out), iter_leaves(template), strict=True):
            assert got is mine
    finally:
        manager.close()


@pytest.mark.parametrize("name", ["UserList", "deque", "Seq"])
def test_safetensors_refuses_a_sequence_leaf_on_save_and_in_a_template(tmp_path: Path, name: str) -> None:
    build = LEAVES[name]
    manager = _manager(SafetensorsSerialization())
    try:
        with pytest.raises(ValueError, match=rf"key 'item\.x' has type '{type(build(_tensor)).__name__}'"):
            manager.save(str(tmp_path / "bad"), {"item": {"x": build(_tensor)}})
        manager.save(str(tmp_path / "c"), {"item": {"x": [_tensor(1), _tensor(2)]}})
        with pytest.raises(TemplateMismatchError, match=r"nested_path=\('x',\)"):
            manager.load(str(tmp_path / "c"), into={"item": {"x": build(_zeros)}})
    finally:
        manager.close()


# ------------------------------------------------------------------------------------------------ async save


def test_async_save_then_load_follows_the_same_rule(async_manager: CheckpointManager, tmp_path: Path) -> None:
    """The staging copy (async) walks the tree like the merge: a container keeps its type through the writer
    process, a leaf is copied whole."""
    write = async_manager.save(str(tmp_path / "c"), {"item": _every_type(_tensor)})
    assert write is not None
    write.result(timeout=120)
    reader = CheckpointManager(
        CheckpointManager.Config(load=CheckpointLoaderConfig(weights_only=False), save=SyncCheckpointSaverConfig())
    )
    try:
        template = _every_type(_zeros)
        before = dict(template)  # the item dict itself is updated in place
        out = reader.load(str(tmp_path / "c"), into={"item": template}, strict=True)["item"]
    finally:
        reader.close()
    expected = _every_type(_tensor)
    for name in CONTAINERS:
        assert type(out[name]) is _returned_type(before[name]) and _same(out[name], expected[name]), name
    for name in LEAVES:
        assert out[name] is not before[name] and _same(out[name], expected[name]), name


# ---------------------------------------------------------------------------------- DTensors, both load paths


def _dtensor_state(mesh: Any, placement: Any, value: Callable[[int], float]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    def dt(i: int) -> Any:
        return distribute_tensor(torch.full((4,), value(i)), mesh, [placement])

    return {"w": dt(1), "layers": [dt(2), {"b": dt(3)}], "pair": (dt(4), dt(5))}


def _saved(i: int) -> float:
    return float(i)


def _blank(i: int) -> float:
    return 0.0


@pytest.mark.parametrize("placement", ["same", "other"], ids=["direct-merge", "resharded"])
def test_dtensor_containers_are_filled_in_place_on_both_paths(mesh: Any, tmp_path: Path, placement: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    manager = _manager(resharder=DTensorResharder())
    try:
        manager.save(str(tmp_path / "c"), {"item": _dtensor_state(mesh, Shard(0), _saved)})
        template = _dtensor_state(mesh, Shard(0) if placement == "same" else Replicate(), _blank)
        mine = [leaf for _, leaf in iter_leaves(template)]
        out = manager.load(str(tmp_path / "c"), into={"item": template}, strict=True)["item"]
    finally:
        manager.close()
    assert type(out["pair"]) is tuple and out["layers"] is template["layers"]
    got = [leaf for _, leaf in iter_leaves(out)]
    assert len(got) == len(mine) and all(g is m for g, m in zip(got, mine, strict=True))
    assert [float(t.to_local()[0]) for t in got] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_userlist_of_dtensors_is_one_leaf_to_the_resharder_and_to_the_merge(mesh: Any, tmp_path: Path) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    def state(value: Callable[[int], float]) -> dict[str, Any]:
        def dt(i: int) -> Any:
            return distribute_tensor(torch.full((4,), value(i)), mesh, [Shard(0)])

        return {"w": dt(1), "ul": collections.UserList([dt(2)])}

    resharder = DTensorResharder()
    assert list(resharder.extract_sharding_metadata("item", state(_blank))) == [("w",)]
    manager = _manager(resharder=resharder, trusting=True)
    try:
        manager.save(str(tmp_path / "c"), {"item": state(_saved)})
        template = state(_blank)
        w, ul = template["w"], template["ul"]
        out = manager.load(str(tmp_path / "c"), into={"item": template}, strict=True)["item"]
    finally:
        manager.close()
    assert out["w"] is w and float(w.to_local()[0]) == 1.0
    assert out["ul"] is not ul and type(out["ul"]) is collections.UserList and float(out["ul"][0].to_local()[0]) == 2.0
    assert float(ul[0].to_local()[0]) == 0.0 and not is_container(ul)


# --------------------------------------------------------------------------------------------------- rank 1


def container_rule_on_two_ranks(root: str) -> dict[str, Any]:
    """Rank function (module level, so spawned ranks import it): a resharded DTensor item in a tuple and a
    list, and per-rank state holding a named tuple and two sequence leaves, loaded back on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def model(scale: float, placement: Any) -> dict[str, Any]:
        def dt(i: int) -> Any:
            return distribute_tensor(torch.arange(4.0) * i * scale, mesh, [placement])

        return {"pair": (dt(1), dt(2)), "layers": [dt(3)]}

    def misc(value: float) -> dict[str, Any]:
        t = torch.full((2,), value)
        return {"nt": Pair(t, int(value)), "ul": collections.UserList([t.clone()]), "dq": collections.deque([value])}

    manager = CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(resharder=DTensorResharder()), "misc": ItemSpec()},
            save=SyncCheckpointSaverConfig(),
            load=CheckpointLoaderConfig(weights_only=False),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )
    try:
        manager.save(str(Path(root) / "c"), {"model": model(1.0, Shard(0)), "misc": misc(10.0 + rank)})
        m_template, s_template = model(0.0, Replicate()), misc(0.0)
        mine = [leaf for _, leaf in iter_leaves(m_template)]
        nt_tensor, ul = s_template["nt"].first, s_template["ul"]
        out = manager.load(str(Path(root) / "c"), into={"model": m_template, "misc": s_template}, strict=True)
    finally:
        manager.close()
    got = [leaf for _, leaf in iter_leaves(out["model"])]
    saved = misc(10.0 + rank)
    return {
        "rank": rank,
        "model_in_place": len(got) == len(mine) and all(g is m for g, m in zip(got, mine, strict=True)),
        "model_values": [t.to_local().tolist() for t in got],
        "pair_is_tuple": type(out["model"]["pair"]) is tuple,
        "nt_in_place": type(out["misc"]["nt"]) is Pair and out["misc"]["nt"].first is nt_tensor,
        "nt_value": (out["misc"]["nt"].first.tolist(), out["misc"]["nt"].second),
        "ul_replaced": out["misc"]["ul"] is not ul and _same(out["misc"]["ul"], saved["ul"]),
        "ul_template_untouched": torch.equal(ul[0], torch.zeros(2)),
        "dq": list(out["misc"]["dq"]),
    }


@pytest.mark.multirank
def test_rank_one_merges_by_the_same_rule(tmp_path: Path) -> None:
    from simulator.launcher import launch

    results = launch(container_rule_on_two_ranks, 2, args=(str(tmp_path),), timeout=180)
    full = [[0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0], [0.0, 3.0, 6.0, 9.0]]
    for r in results:
        rank = r["rank"]
        assert r["model_in_place"] and r["pair_is_tuple"] and r["model_values"] == full, r
        assert r["nt_in_place"] and r["nt_value"] == ([10.0 + rank] * 2, 10 + rank), r
        assert r["ul_replaced"] and r["ul_template_untouched"] and r["dq"] == [10.0 + rank], r
