"""Loading into templates (`into=`): in-place fills, filtering, strictness, relocation and safe unpickling."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.memory_storage import MemoryStorageConfig
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization, TorchSerialization
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError, CorruptCheckpointError, TemplateMismatchError
from torch_checkpointing.walk_utils import walk_checkpoint_structure


def _manager(storage: Any = None, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage, **kwargs)
    )


@pytest.fixture
def mgr() -> Any:
    manager = _manager(MemoryStorageConfig())
    yield manager
    manager.close()


# ------------------------------------------------------------------------------------ property: the merge

tensors = st.builds(
    lambda shape, dtype: (torch.rand(shape) * 10).to(dtype),
    st.lists(st.integers(0, 3), max_size=2).map(tuple),
    st.sampled_from([torch.float32, torch.int64, torch.float16]),
)
leaves = st.one_of(st.integers(-5, 5), st.text("xyz", max_size=3), st.floats(allow_nan=False), tensors)
names = st.text("abcde", min_size=1, max_size=3)
sources = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, min_size=1, max_size=3),
        st.dictionaries(names, kids, min_size=1, max_size=3),
        st.lists(kids, min_size=1, max_size=3).map(tuple),
    ),
    max_leaves=10,
)


def make_template(source: Any, data: st.DataObject) -> Any:
    """A template a user might pass: a sub-structure of `source`, leaves of the same type, some subtrees None."""
    if data.draw(st.integers(0, 5)) == 0:
        return None
    if isinstance(source, torch.Tensor):
        return torch.zeros_like(source)
    if isinstance(source, dict):
        keys = data.draw(st.lists(st.sampled_from(sorted(source)), unique=True, max_size=len(source)))
        return {k: make_template(source[k], data) for k in keys}
    if isinstance(source, (list, tuple)):
        n = data.draw(st.integers(1, len(source)))
        items = [make_template(source[i], data) for i in range(n)]
        return items if isinstance(source, list) else tuple(items)
    if isinstance(source, str):
        return ""
    return type(source)(0)


def expected_merge(source: Any, template: Any) -> Any:
    if template is None:
        return source
    if isinstance(template, dict):
        merged = {k: expected_merge(source[k], t) for k, t in template.items()}
        merged.update((k, v) for k, v in source.items() if k not in template)  # entries the template lacks: kept
        return merged
    if isinstance(template, (list, tuple)):
        items = [expected_merge(source[i], t) for i, t in enumerate(template)]
        return type(template)([*items, *source[len(template) :]])
    return source


def _sub(template: Any, key: Any) -> Any:
    if isinstance(template, dict):
        return template.get(key)
    return template[key] if template is not None and key < len(template) else None


def check(actual: Any, expected: Any, template: Any) -> None:
    if isinstance(template, torch.Tensor):
        assert actual is template, "tensor template must be filled in place"
        assert torch.equal(actual, expected)
        return
    if isinstance(template, (dict, list)):
        assert actual is template, "mutable container must be updated in place"
    if isinstance(template, tuple):
        assert type(actual) is tuple
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected) and actual.dtype == expected.dtype
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected)
        for k in expected:
            check(actual[k], expected[k], _sub(template, k))
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for i, e in enumerate(expected):
            check(actual[i], e, _sub(template, i))
    else:
        assert actual == expected


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=st.dictionaries(names, sources, min_size=1, max_size=3), data=st.data())
def test_merge_into_template_property(source: dict[str, Any], data: st.DataObject) -> None:
    storage = MemoryStorageConfig()
    manager = _manager(storage)
    try:
        manager.save("/ck", {"item": source})
        template = make_template(source, data)
        expected = expected_merge(source, template)
        # A template lacking entries the checkpoint holds: strict refuses, non-strict returns them too.
        out = manager.load("/ck", into={"item": template}, strict=False)
        check(out["item"], expected, template)
    finally:
        manager.close()


# -------------------------------------------------------------------------------------- specific rules


def test_tensors_are_copied_into_the_template(mgr: CheckpointManager) -> None:
    model = torch.nn.Linear(3, 2)
    mgr.save("/ck", {"model": model.state_dict()})
    fresh = torch.nn.Linear(3, 2)
    weight = fresh.weight
    sd = fresh.state_dict()
    out = mgr.load("/ck", into={"model": sd})
    assert out["model"] is sd and out["model"]["weight"] is sd["weight"]
    assert fresh.weight is weight and torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh.bias, model.bias)


def test_mutable_containers_updated_in_place_tuples_and_leaves_replaced(mgr: CheckpointManager) -> None:
    mgr.save("/ck", {"s": {"lst": [1, 2, 3], "tup": (4, torch.ones(1)), "od": OrderedDict(a=1), "n": 5, "txt": "new"}})
    lst, od, inner_t = [0, 0, 0], OrderedDict(a=0), torch.zeros(1)
    tup = (0, inner_t)
    template = {"lst": lst, "tup": tup, "od": od, "n": 0, "txt": "old"}
    out = mgr.load("/ck", into={"s": template})["s"]
    assert out is template
    assert out["lst"] is lst and lst == [1, 2, 3]
    assert out["od"] is od and od == {"a": 1}
    assert out["tup"] is not tup and out["tup"][0] == 4 and out["tup"][1] is inner_t
    assert out["n"] == 5 and out["txt"] == "new"


def test_template_filters_keys_and_indices(mgr: CheckpointManager) -> None:
    mgr.save("/ck", {"s": {"keep": {"a": 1, "b": 2}, "drop": 3, "seq": [10, 20, 30]}})
    # Entries the template lacks are returned (not dropped); strict refuses them, changing nothing.
    template = {"keep": {"a": 0}, "seq": [0, 0]}
    with pytest.raises(TemplateMismatchError, match=r"s::keep.b.*s::seq.2.*s::drop|s::keep.b"):
        mgr.load("/ck", into={"s": template}, strict=True)
    assert template == {"keep": {"a": 0}, "seq": [0, 0]}
    out = mgr.load("/ck", into={"s": template})
    assert out == {"s": {"keep": {"a": 1, "b": 2}, "seq": [10, 20, 30], "drop": 3}}


def test_empty_list_template_takes_the_whole_sequence(mgr: CheckpointManager) -> None:
    mgr.save("/ck", {"s": {"seq": [1, 2, 3]}})
    assert mgr.load("/ck", into={"s": {"seq": []}})["s"]["seq"] == [1, 2, 3]


def test_none_template_loads_the_whole_item(mgr: CheckpointManager) -> None:
    value = {"a": {"b": [1, (2, 3)], "t": torch.arange(3)}, "z": None}
    mgr.save("/ck", {"item": value, "other": 1})
    out = mgr.load("/ck", into={"item": None})
    assert set(out) == {"item"}
    assert out["item"]["a"]["b"] == [1, (2, 3)] and torch.equal(out["item"]["a"]["t"], torch.arange(3))
    assert out["item"]["z"] is None


def test_into_none_reads_declared_items() -> None:
    storage = MemoryStorageConfig()
    manager = _manager(storage, items={"model": ItemSpec(), "step": ItemSpec(), "opt": ItemSpec(required=False)})
    try:
        manager.save("/ck", {"model": {"w": torch.ones(2)}, "step": 4, "undeclared": 1})
        out = manager.load("/ck")
        assert set(out) == {"model", "step"}
        assert out["step"] == 4 and torch.equal(out["model"]["w"], torch.ones(2))
    finally:
        manager.close()


def test_empty_into_loads_nothing(mgr: CheckpointManager) -> None:
    mgr.save("/ck", {"a": 1})
    assert mgr.load("/ck", into={}) == {}


def test_strict_names_missing_nested_paths(mgr: CheckpointManager) -> None:
    mgr.save("/ck", {"model": {"a": {"b": torch.ones(1)}, "l": [1]}})
    template = {"a": {"b": torch.zeros(1), "c": torch.zeros(1)}, "l": [0, 0], "gone": 1}
    out = mgr.load("/ck", into={"model": template})
    assert torch.equal(out["model"]["a"]["b"], torch.ones(1))
    assert out["model"]["gone"] == 1  # kept, reported missing
    with pytest.raises(RuntimeError) as info:
        mgr.load(
            "/ck",
            into={"model": {"a": {"b": torch.zeros(1), "c": torch.zeros(1)}, "l": [0, 0], "gone": 1}},
            strict=True,
        )
    message = str(info.value)
    assert "/ck" in message
    for path in ("model::a.c", "model::l.1", "model::gone"):
        assert path in message


def test_shape_mismatch_names_the_path_and_resizes_nothing(mgr: CheckpointManager) -> None:
    mgr.save("/ck", {"model": {"layer": {"w": torch.ones(2, 3)}}})
    target = torch.zeros(3, 2)
    with pytest.raises(RuntimeError) as info:
        mgr.load("/ck", into={"model": {"layer": {"w": target}}})
    assert "model::layer.w" in str(info.value) and "(2, 3)" in str(info.value)
    assert target.shape == (3, 2) and torch.equal(target, torch.zeros(3, 2))


def test_dtype_mismatch_names_the_path(mgr: CheckpointManager) -> None:
    mgr.save("/ck", {"model": {"w": torch.ones(2, dtype=torch.float64)}})
    target = torch.zeros(2, dtype=torch.float32)
    with pytest.raises(RuntimeError) as info:
        mgr.load("/ck", into={"model": {"w": target}})
    assert "model::w" in str(info.value) and "float64" in str(info.value)
    assert torch.equal(target, torch.zeros(2))


@pytest.mark.parametrize(
    ("saved", "template"),
    [(torch.ones(1), 0), (3, torch.zeros(1)), ({"a": 1}, [1]), ([1], {"a": 1}), ("s", 1)],
    ids=["int-vs-tensor", "tensor-vs-int", "list-vs-dict", "dict-vs-list", "int-vs-str"],
)
def test_type_mismatch_names_the_path(mgr: CheckpointManager, saved: Any, template: Any) -> None:
    mgr.save("/ck", {"model": {"x": saved}})
    with pytest.raises(RuntimeError, match=r"nested_path=\('x',\).*'model'"):
        mgr.load("/ck", into={"model": {"x": template}})


@pytest.mark.parametrize("map_location", ["meta", torch.device("meta"), {"cpu": "meta"}])
def test_map_location_relocates_tensors(mgr: CheckpointManager, map_location: Any) -> None:
    mgr.save("/ck", {"model": {"w": torch.ones(4), "n": 1}})
    out = mgr.load("/ck", into={"model": None}, map_location=map_location)
    assert out["model"]["w"].device.type == "meta" and out["model"]["w"].shape == (4,)
    assert out["model"]["n"] == 1


def test_map_location_on_the_local_filesystem(tmp_path: Path) -> None:
    manager = _manager()
    try:
        manager.save(str(tmp_path / "c"), {"model": {"w": torch.ones(4)}})
        out = manager.load(str(tmp_path / "c"), into={"model": None}, map_location="meta")
        assert out["model"]["w"].device.type == "meta"
    finally:
        manager.close()


_META_FORMATS = {"torch": TorchSerialization(), "safetensors": SafetensorsSerialization()}


def _to_meta(storage: Any, location: str) -> Any:
    """A callable map_location (torch.load's form) that sends every storage to the meta device."""
    return torch.empty(0, device="meta").untyped_storage()


@pytest.mark.parametrize(
    ("fmt", "map_location"),
    [
        ("torch", "meta"),
        ("torch", torch.device("meta")),
        ("torch", {"cpu": "meta"}),
        ("safetensors", "meta"),
        # a callable, or a dict sending the saved device there among others: seen only as the file is read
        ("torch", _to_meta),
        ("torch", {"cpu": "meta", "cuda:0": "cpu"}),
    ],
)
def test_map_location_meta_into_a_template_names_the_argument(tmp_path: Path, fmt: str, map_location: Any) -> None:
    """A templated load copies the stored values into the template, so `map_location="meta"` leaves nothing to
    copy. That is the caller's argument, not damage: it was a CorruptCheckpointError ("The checkpoint holds a
    meta tensor ... re-save from a materialised model"), which sends people to re-save or delete a healthy
    checkpoint."""
    layout = LayoutInfo(f"model.{fmt}", _META_FORMATS[fmt])
    manager = _manager(items={"model": ItemSpec(layout=layout)})
    try:
        manager.save(str(tmp_path / "c"), {"model": {"w": torch.ones(4)}})
        template = torch.zeros(4)
        with pytest.raises(ConfigError, match=r"map_location.*'model'") as info:
            manager.load(str(tmp_path / "c"), into={"model": {"w": template}}, map_location=map_location)
        assert not isinstance(info.value, CorruptCheckpointError), info.value
        assert torch.equal(template, torch.zeros(4))
        manager.load(str(tmp_path / "c"), into={"model": {"w": template}})  # the checkpoint is fine
        assert torch.equal(template, torch.ones(4))
    finally:
        manager.close()


def test_a_dict_map_location_sending_only_other_devices_to_meta_still_fills_the_template(tmp_path: Path) -> None:
    """{"cuda:0": "meta"} leaves a checkpoint saved from the CPU where it is: the load fills the template, as it
    did before meta refusals (it was refused as if every storage went to meta)."""
    manager = _manager()
    try:
        manager.save(str(tmp_path / "c"), {"model": {"w": torch.ones(4)}})
        template = torch.zeros(4)
        manager.load(str(tmp_path / "c"), into={"model": {"w": template}}, map_location={"cuda:0": "meta"})
        assert torch.equal(template, torch.ones(4))
    finally:
        manager.close()


def test_walk_records_missing_paths_directly() -> None:
    target = {"a": 1, "b": [1, 2]}
    merged, missing = walk_checkpoint_structure(item_key="k", source={"a": 2, "b": [3]}, target=target)
    assert merged is target and merged == {"a": 2, "b": [3, 2]}
    assert [str(m) for m in missing] == ["k::b.1"]


# --------------------------------------------------------------------------------------- weights_only


class Custom:
    def __init__(self, v: int) -> None:
        self.v = v


@pytest.mark.parametrize("use_mmap", [True, False])
def test_torch_files_load_with_weights_only_by_default(tmp_path: Path, use_mmap: bool) -> None:
    saver = _manager()
    try:
        saver.save(str(tmp_path / "c"), {"obj": {"c": Custom(3)}, "plain": {"t": torch.ones(1), "n": [1, "a"]}})
    finally:
        saver.close()
    safe = _manager(load=CheckpointLoaderConfig(use_mmap=use_mmap))
    trusting = _manager(load=CheckpointLoaderConfig(use_mmap=use_mmap, weights_only=False))
    try:
        assert safe.load(str(tmp_path / "c"), into={"plain": None})["plain"]["n"] == [1, "a"]
        with pytest.raises(pickle.UnpicklingError) as info:
            safe.load(str(tmp_path / "c"), into={"obj": None})
        message = str(info.value)
        assert "'obj'" in message and "CheckpointLoaderConfig(weights_only=False)" in message
        assert trusting.load(str(tmp_path / "c"), into={"obj": None})["obj"]["c"].v == 3
    finally:
        safe.close()
        trusting.close()
