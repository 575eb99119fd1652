"""The four serialization formats: what each writes, what each refuses, and what comes back."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from tests.memory_storage import MemoryStorageConfig
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
    TorchSerialization,
)
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.encoding import decode, encode
from torch_checkpointing.safetensors_tree import flatten_tensors

HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _manager(fmt: Any, file_path: str = "item.bin", storage: Any = None) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items={"item": ItemSpec(layout=LayoutInfo(file_path, fmt))},
            save=SyncCheckpointSaverConfig(),
            storage_config=storage,
        )
    )


@pytest.fixture
def mem() -> MemoryStorageConfig:
    return MemoryStorageConfig()


def _round_trip(fmt: Any, value: Any, into: Any = None, *, strict: bool = False, **load: Any) -> tuple[Any, bytes]:
    """Save `value` through an in-memory backend, load it back; returns (loaded, file bytes)."""
    storage = MemoryStorageConfig()
    manager = _manager(fmt, storage=storage)
    try:
        manager.save("/ck", {"item": value})
        out = manager.load("/ck", into={"item": into}, strict=strict, **load)["item"]
        return out, storage.store.files["/ck/item.bin"]
    finally:
        manager.close()


# --------------------------------------------------------------------------------------------- torch

tensors = st.builds(
    lambda shape, dtype: torch.randn(shape).to(dtype),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.bool]),
)
leaves = st.one_of(st.integers(), st.text(max_size=5), st.booleans(), st.none(), tensors)
names = st.text("abcdefgh_", min_size=1, max_size=4)
trees = st.recursive(
    leaves,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(names, kids, max_size=3), st.tuples(kids, kids)),
    max_leaves=10,
)


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=False):
            assert_same(x, y)
    else:
        assert a == b


@HYP
@given(value=trees)
def test_torch_round_trip(value: Any) -> None:
    out, data = _round_trip(TorchSerialization(), value)
    assert_same(out, value)
    import io

    assert_same(torch.load(io.BytesIO(data), weights_only=True), value)


# ---------------------------------------------------------------------------------------------- json

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**53), 2**53),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=6),
    ),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=4), kids, max_size=3)),
    max_leaves=12,
)


@HYP
@given(value=json_values)
def test_json_is_sorted_indented_and_round_trips(value: Any) -> None:
    out, data = _round_trip(JsonSerialization(), value)
    assert data.decode("utf-8") == json.dumps(value, sort_keys=True, indent=4)
    assert out == value


def test_json_tuples_become_lists() -> None:
    out, _ = _round_trip(JsonSerialization(), {"t": (1, 2)})
    assert out == {"t": [1, 2]}


def test_json_refuses_non_json_values_naming_the_key() -> None:
    with pytest.raises(TypeError, match="'item'"):
        _round_trip(JsonSerialization(), {"t": torch.ones(1)})


@dataclass
class Inner:
    a: int
    b: str = "x"


@dataclass
class Outer:
    name: str
    inner: Inner
    maybe: Inner | None = None
    legacy: Inner | None = None
    many: list[Inner] = field(default_factory=list)
    by_name: dict[str, Inner] = field(default_factory=dict)
    absent_optional: Inner | None = None
    lr: float = 0.1


def _outer() -> Outer:
    return Outer(
        name="run",
        inner=Inner(1),
        maybe=Inner(2, "y"),
        legacy=Inner(3),
        many=[Inner(4), Inner(5, "z")],
        by_name={"k": Inner(6)},
        lr=0.5,
    )


def test_json_cls_rebuilds_nested_dataclasses_from_a_dataclass_instance() -> None:
    value = _outer()
    out, data = _round_trip(JsonSerialization(cls=Outer), value)
    assert out == value
    assert type(out.maybe) is Inner and type(out.legacy) is Inner and type(out.many[1]) is Inner
    assert type(out.by_name["k"]) is Inner
    assert json.loads(data)["inner"] == {"a": 1, "b": "x"}


def test_json_cls_from_a_dict_payload_with_missing_optional_and_defaulted_fields() -> None:
    out, _ = _round_trip(JsonSerialization(cls=Outer), {"name": "n", "inner": {"a": 7}, "ignored": 1})
    assert out == Outer(name="n", inner=Inner(7))


def test_json_cls_template_instance_is_replaced() -> None:
    template = Outer(name="old", inner=Inner(0))
    out, _ = _round_trip(JsonSerialization(cls=Outer), _outer(), into=template)
    assert out == _outer()


def test_json_cls_missing_required_field_names_it() -> None:
    with pytest.raises(ValueError, match="inner"):
        _round_trip(JsonSerialization(cls=Outer), {"name": "n"})


def test_json_cls_none_returns_plain_json() -> None:
    out, _ = _round_trip(JsonSerialization(), _outer())
    assert isinstance(out, dict) and out["inner"] == {"a": 1, "b": "x"}


def test_json_cls_non_dataclass_returns_decoded_value() -> None:
    out, _ = _round_trip(JsonSerialization(cls=dict), {"a": 1})
    assert out == {"a": 1}


# ----------------------------------------------------------------------------------------------- raw


@HYP
@given(value=st.binary(max_size=10_000))
def test_raw_writes_bytes_as_is(value: bytes) -> None:
    out, data = _round_trip(RawSerialization(), value)
    assert data == value and out == value and type(out) is bytes


@pytest.mark.parametrize("value", ["text", bytearray(b"ab"), memoryview(b"ab"), 3, None])
def test_raw_refuses_non_bytes_naming_the_key(value: Any) -> None:
    storage = MemoryStorageConfig()
    manager = _manager(RawSerialization(), storage=storage)
    try:
        with pytest.raises(
            ValueError, match=f"RawSerialization requires bytes, but key 'item' has type '{type(value).__name__}'"
        ):
            manager.save("/ck", {"item": value})
    finally:
        manager.close()
    assert not any(name.startswith("/ck/") or name == "/ck" for name in storage.store.files)


# ----------------------------------------------------------------------------------------- safetensors

st_names = st.text("abcdefgh_", min_size=1, max_size=4)
st_tensors = st.builds(
    lambda shape, dtype: torch.randn(shape).to(dtype),
    st.lists(st.integers(1, 3), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.float16, torch.int32, torch.bfloat16]),
)
st_trees = st.recursive(
    st_tensors,
    lambda kids: st.one_of(
        st.lists(kids, min_size=1, max_size=3),
        st.dictionaries(st_names, kids, min_size=1, max_size=3),
        st.tuples(kids, kids),
    ),
    max_leaves=8,
)


def zeros_like_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: zeros_like_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [zeros_like_tree(v) for v in value]
    return tuple(zeros_like_tree(v) for v in value)


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    children = value.values() if isinstance(value, dict) else value
    return [t for c in children for t in tensor_leaves(c)]


@HYP
@given(value=st.dictionaries(st_names, st_trees, min_size=1, max_size=3))
def test_safetensors_round_trips_into_a_template(value: dict[str, Any]) -> None:
    template = zeros_like_tree(value)
    template_leaves = tensor_leaves(template)
    out, _ = _round_trip(SafetensorsSerialization(), value, into=template, strict=True)
    assert_same(out, value)
    for kept, original in zip(tensor_leaves(out), template_leaves, strict=False):
        assert kept is original


@HYP
@given(value=st.dictionaries(st_names, st_trees, min_size=1, max_size=3))
def test_safetensors_flat_keys_are_dotted_paths(value: dict[str, Any]) -> None:
    expected: dict[str, torch.Tensor] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            expected[prefix] = v
            return
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, c in items:
            walk(f"{prefix}.{k}" if prefix else str(k), c)

    walk("", value)
    out, _ = _round_trip(SafetensorsSerialization(), value, into=None)
    assert set(out) == set(expected)
    for k, t in expected.items():
        assert torch.equal(out[k], t)


def test_safetensors_flatten_scheme_example() -> None:
    t = torch.ones(1)
    flat = flatten_tensors({"a": {"b": t, "c": [t, t]}, "t": (t,), 0: {1: t}})
    assert set(flat) == {"a.b", "a.c.0", "a.c.1", "t.0", "0.1"}
    assert set(flatten_tensors(t)) == {""}
    assert flatten_tensors({}) == {}


@pytest.mark.parametrize(
    ("value", "dotted", "type_name"),
    [
        ({"a": {"b": 3}}, "item.a.b", "int"),
        ({"l": [torch.ones(1), "s"]}, "item.l.1", "str"),
        ({"n": None}, "item.n", "NoneType"),
        (5, "item", "int"),
    ],
)
def test_safetensors_refuses_non_tensor_leaves(value: Any, dotted: str, type_name: str) -> None:
    with pytest.raises(ValueError) as info:
        _round_trip(SafetensorsSerialization(), value)
    message = str(info.value)
    assert f"'{dotted}'" in message and f"'{type_name}'" in message
    assert "TorchSerialization" in message


def test_safetensors_refuses_a_dtype_the_library_cannot_store_naming_the_key() -> None:
    """complex128 is not in safetensors' dtype table: a bare `KeyError: torch.complex128` before."""
    value = {"ok": torch.ones(2, dtype=torch.complex64), "z": {"w": torch.ones(2, dtype=torch.complex128)}}
    with pytest.raises(ValueError, match=r"'item\.z\.w'.*no torch\.complex128 dtype.*TorchSerialization"):
        _round_trip(SafetensorsSerialization(), value)


def test_safetensors_missing_dict_leaves_are_dropped_and_reported() -> None:
    saved = {"a": torch.ones(2), "sub": {"x": torch.ones(1)}}
    keep_b, keep_y = torch.full((2,), 7.0), torch.full((1,), 9.0)
    template = {"a": torch.zeros(2), "b": keep_b, "sub": {"x": torch.zeros(1), "y": keep_y}}
    out, _ = _round_trip(SafetensorsSerialization(), saved, into=template)
    assert out is not None and torch.equal(out["a"], torch.ones(2))
    assert out["b"] is keep_b and torch.equal(keep_b, torch.full((2,), 7.0))
    assert out["sub"]["y"] is keep_y
    with pytest.raises(RuntimeError) as info:
        _round_trip(SafetensorsSerialization(), saved, into=template, strict=True)
    assert "item::b" in str(info.value) and "item::sub.y" in str(info.value)


@pytest.mark.parametrize("container", [list, tuple])
def test_safetensors_missing_sequence_leaves_come_back_none(container: type) -> None:
    saved = {"l": container([torch.ones(2)])}
    template = {"l": container([torch.zeros(2), torch.zeros(3)])}
    out, _ = _round_trip(SafetensorsSerialization(), saved, into=template)
    assert type(out["l"]) is container
    assert torch.equal(out["l"][0], torch.ones(2))
    assert out["l"][1] is None
    with pytest.raises(RuntimeError, match=r"item::l\.1"):
        _round_trip(
            SafetensorsSerialization(), saved, into={"l": container([torch.zeros(2), torch.zeros(3)])}, strict=True
        )


def test_safetensors_makes_tensors_contiguous() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    value = {"t": base.t(), "s": base[:, 1]}
    assert not value["t"].is_contiguous() and not value["s"].is_contiguous()
    out, _ = _round_trip(SafetensorsSerialization(), value, into={"t": torch.zeros(4, 3), "s": torch.zeros(3)})
    assert torch.equal(out["t"], base.t()) and torch.equal(out["s"], base[:, 1])


def test_safetensors_tied_tensors_are_saved() -> None:
    t = torch.arange(4.0)
    out, _ = _round_trip(SafetensorsSerialization(), {"a": t, "b": t, "v": t[:2]}, into=None)
    assert torch.equal(out["a"], t) and torch.equal(out["b"], t) and torch.equal(out["v"], t[:2])


def test_safetensors_metadata_is_embedded(tmp_path: Path) -> None:
    fmt = SafetensorsSerialization(metadata={"format_version": "1", "note": "hi"})
    manager = _manager(fmt, "model_state.safetensors")
    try:
        manager.save(str(tmp_path / "c"), {"item": {"w": torch.ones(2)}})
    finally:
        manager.close()
    with safe_open(str(tmp_path / "c" / "model_state.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format_version": "1", "note": "hi"}
        assert torch.equal(f.get_tensor("w"), torch.ones(2))


@pytest.mark.parametrize("metadata", [{"v": 1}, {1: "v"}, {"v": None}, ["a"]])
def test_safetensors_metadata_must_be_str_to_str(metadata: Any) -> None:
    with pytest.raises(TypeError, match="str"):
        SafetensorsSerialization(metadata=metadata)


def test_safetensors_equality_and_hash() -> None:
    assert SafetensorsSerialization({"a": "1", "b": "2"}) == SafetensorsSerialization({"b": "2", "a": "1"})
    assert hash(SafetensorsSerialization({"a": "1", "b": "2"})) == hash(SafetensorsSerialization({"b": "2", "a": "1"}))
    assert SafetensorsSerialization() != SafetensorsSerialization({"a": "1"})


def test_safetensors_map_location() -> None:
    out, _ = _round_trip(SafetensorsSerialization(), {"w": torch.ones(2)}, into=None, map_location="meta")
    assert out["w"].device.type == "meta"
    with pytest.raises(ValueError, match="map_location must be a str or torch.device"):
        _round_trip(SafetensorsSerialization(), {"w": torch.ones(2)}, into=None, map_location=lambda s, _loc: s)


@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_safetensors_unwraps_dtensor_leaves(mesh: Any, tmp_path: Path, placement: str) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(8.0).reshape(4, 2)
    dt = distribute_tensor(full, mesh, [Shard(0) if placement == "shard" else Replicate()])
    manager = _manager(SafetensorsSerialization(), "m.safetensors")
    try:
        manager.save(str(tmp_path / "c"), {"item": {"w": dt}})
        with safe_open(str(tmp_path / "c" / "m.safetensors"), framework="pt") as f:
            stored = f.get_tensor("w")
        assert type(stored) is torch.Tensor and torch.equal(stored, full)
        plain = torch.zeros(4, 2)
        out = manager.load(str(tmp_path / "c"), into={"item": {"w": plain}})
        assert out["item"]["w"] is plain and torch.equal(plain, full)
        target = distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()])
        out = manager.load(str(tmp_path / "c"), into={"item": {"w": target}})
        assert out["item"]["w"] is target and torch.equal(target.to_local(), full)
    finally:
        manager.close()


# ------------------------------------------------------------------------------------ encode/decode unit


def test_encode_refuses_unknown_formats() -> None:
    import io

    class Fake:
        pass

    with pytest.raises(ValueError, match="Unsupported serialization format for key 'k'"):
        encode(Fake(), "k", 1, io.BytesIO())  # type: ignore[arg-type]


def test_decode_json_float_precision(mem: MemoryStorageConfig) -> None:
    storage = mem.create_storage()
    storage.mkdir(Path("/d"))
    import io

    buf = io.BytesIO()
    encode(JsonSerialization(), "k", {"pi": math.pi}, buf)
    storage.write(Path("/d/f.json"), buf.getvalue())
    assert decode(JsonSerialization(), storage, Path("/d/f.json"), "k") == {"pi": math.pi}
