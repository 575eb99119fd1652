"""The one traversal of nested state: the container rule, the dotted-key rule (an on-disk contract), and
DTensor unwrapping."""

from __future__ import annotations

import io
import json
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch

from tests.container_types import Frozen, KeywordMap, Pair
from torch_checkpointing.checkpoint_layout import JsonSerialization, SafetensorsSerialization
from torch_checkpointing.encoding import decode, encode
from torch_checkpointing.safetensors_tree import flatten_tensors
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.traversal import (
    any_leaf,
    dotted_key,
    flatten,
    get_path,
    is_dtensor,
    iter_leaves,
    local_tensor,
    map_leaves,
)


def _old_flatten_keys(data: Any) -> list[str]:
    """The dotted keys the safetensors encoder wrote before the traversal existed (its own recursive walk)."""
    keys: list[str] = []

    def join(prefix: str, part: object) -> str:
        return f"{prefix}.{part}" if prefix else str(part)

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            keys.append(prefix)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(join(prefix, k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(join(prefix, i), v)

    visit("", data)
    return keys


def _t(n: float) -> torch.Tensor:
    return torch.full((2,), n)


_NESTED = {
    "model": {"layers": [{"w": _t(0), "b": _t(1)}, {"w": _t(2), "b": _t(3)}], "head": (_t(4), _t(5))},
    3: {"x": _t(6)},
    "pair": Pair(_t(7), [_t(8)]),
    "od": OrderedDict([("z", _t(9)), ("a", _t(10))]),
    "": {"blank": _t(11)},
    "mid": {"": _t(12)},
    "empty": {},
}


def test_dotted_keys_are_the_rule_safetensors_files_were_written_with() -> None:
    old = _old_flatten_keys(_NESTED)
    assert [dotted_key(path) for path, _ in iter_leaves(_NESTED)] == old
    assert list(flatten_tensors(_NESTED, "item")) == old
    assert list(flatten(_NESTED)) == old
    assert old[:4] == ["model.layers.0.w", "model.layers.0.b", "model.layers.1.w", "model.layers.1.b"]
    assert "3.x" in old and "pair.1.0" in old and "blank" in old and "mid." in old


def test_the_design_document_example() -> None:
    t = torch.zeros(1)
    value = {"a": {"b": t, "c": [t, t]}, "t": (t,)}
    assert list(flatten(value)) == ["a.b", "a.c.0", "a.c.1", "t.0"]
    assert list(flatten({0: t, "x": {1: t}})) == ["0", "x.1"]
    assert list(flatten(t)) == [""] and flatten({}) == {}


@pytest.mark.parametrize(
    "wrap", [Frozen, MappingProxyType, OrderedDict, dict], ids=["Mapping", "MappingProxy", "OrderedDict", "dict"]
)
def test_mapping_subclasses_walk_like_dict(wrap: Any) -> None:
    def build(layer: int) -> Any:
        return wrap({"w": _t(layer), "b": [_t(layer + 1)]})

    as_dict = {"l0": {"w": _t(0), "b": [_t(1)]}, "l1": {"w": _t(2), "b": [_t(3)]}}
    value = wrap({"l0": build(0), "l1": build(2)})
    assert [p for p, _ in iter_leaves(value)] == [p for p, _ in iter_leaves(as_dict)]
    assert list(flatten_tensors(value)) == list(flatten_tensors(as_dict))
    assert get_path(value, ("l1", "b", 0)) is value["l1"]["b"][0]
    assert any_leaf(value, lambda x: isinstance(x, torch.Tensor) and x[0] == 3)


def test_json_encodes_any_mapping_like_a_dict(tmp_path: Path) -> None:
    # Before: only dicts were converted, so a Mapping that is not a dict reached json.dumps and was refused.
    plain, frozen = io.BytesIO(), io.BytesIO()
    encode(JsonSerialization(), "cfg", {"lr": 0.1, "sched": {"warmup": 10}}, plain)
    encode(JsonSerialization(), "cfg", KeywordMap(lr=0.1, sched=KeywordMap(warmup=10)), frozen)
    assert frozen.getvalue() == plain.getvalue()
    assert json.loads(frozen.getvalue()) == {"lr": 0.1, "sched": {"warmup": 10}}


def test_json_refuses_non_str_keys_inside_any_mapping() -> None:
    with pytest.raises(TypeError, match=r"dict key 1 at 'outer\.1' is a int"):
        encode(JsonSerialization(), "cfg", KeywordMap(outer={1: "x"}), io.BytesIO())


def test_safetensors_round_trips_a_mapping_template(tmp_path: Path) -> None:
    storage = LocalFileSystemStorageConfig().create_storage()
    value = KeywordMap(layer=KeywordMap(w=_t(1)), seq=(_t(2),))
    path = tmp_path / "m.safetensors"
    with open(path, "wb") as f:
        encode(SafetensorsSerialization(), "m", value, f)
    got = decode(SafetensorsSerialization(), storage, path, "m", template=value)
    assert torch.equal(got["layer"]["w"], _t(1)) and torch.equal(got["seq"][0], _t(2))


def test_get_path_is_none_where_the_path_leaves_the_tree() -> None:
    value = {"a": [{"b": 1}], "t": (5, 6)}
    assert get_path(value, ("a", 0, "b")) == 1
    assert get_path(value, ("t", -1)) == 6
    assert get_path(value, ()) is value
    for missing in [("x",), ("a", 1), ("a", "0"), ("a", 0, "b", "c"), ("t", 2)]:
        assert get_path(value, missing) is None, missing


def test_map_leaves_keeps_container_types() -> None:
    value = {"od": OrderedDict(a=1), "pair": Pair(1, [2, (3,)]), "fm": KeywordMap(x=4)}
    out = map_leaves(value, lambda x: x * 10)
    assert type(out["od"]) is OrderedDict and out["od"] == {"a": 10}
    assert type(out["pair"]) is Pair and out["pair"] == (10, [20, (30,)])
    assert dict(out["fm"]) == {"x": 40}  # rebuilt as a dict: KeywordMap takes keywords, not items


def test_local_tensor_leaves_plain_values_alone() -> None:
    t = torch.ones(2)
    assert local_tensor(t) is t and local_tensor(3) == 3 and not is_dtensor(t)


@pytest.mark.usefixtures("dist_world1")
def test_local_tensor_is_the_dtensor_shard_itself() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    dt = distribute_tensor(torch.arange(4.0, requires_grad=True), mesh, [Shard(0)])
    assert is_dtensor(dt)
    local = local_tensor(dt)
    assert type(local) is torch.Tensor and local.grad_fn is None  # no autograd view, even with grad enabled
    assert local.data_ptr() == dt.to_local().data_ptr() and torch.equal(local, torch.arange(4.0))
    with torch.no_grad():
        local.add_(1)
    assert torch.equal(dt.full_tensor(), torch.arange(1.0, 5.0))
    assert flatten({"w": dt})["w"] is local


def test_leaves_are_the_leaves_of_iter_leaves_in_the_same_order() -> None:
    """The path-free walk (staging's hot path) visits exactly what the one traversal visits, in its order."""
    from collections import OrderedDict

    from torch_checkpointing.traversal import leaves

    value = {"a": [torch.ones(1), (torch.zeros(1), {"b": 3})], "c": OrderedDict(x=[], y=[5, 6]), "d": (), "e": "s"}
    assert [id(x) for x in leaves(value)] == [id(x) for _, x in iter_leaves(value)]
    assert list(leaves(7)) == [7] and list(leaves({})) == []
