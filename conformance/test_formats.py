"""The four serialization formats and the rule that custom formats are not supported."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from conformance import backend
from conformance.helpers import Where, files, layout, local_file, read_bytes, read_text, save, spec, torch_load

clause = pytest.mark.clause
Factory = Callable[..., Any]


@dataclass
class UserObject:
    """A user-defined picklable object (module level, so it pickles by reference)."""

    name: str
    sizes: tuple[int, ...]


@dataclass
class StepInfo:
    """A JSON-reconstructable type for JsonSerialization(cls=...)."""

    step: int
    tag: str


@dataclass
class Limits:
    """A dataclass nested in RunInfo's fields."""

    low: int
    high: int


@dataclass
class RunInfo:
    """A JsonSerialization(cls=...) type whose fields are dataclasses: plain, optional and in a list."""

    bounds: Limits
    fallback: Limits | None = None
    history: list[Limits] = field(default_factory=list)
    pair: tuple[Limits, int] | None = None
    seen: Sequence[Limits] = ()
    named: Mapping[str, Limits] = field(default_factory=dict)


class Span(NamedTuple):
    """A NamedTuple for JsonSerialization(cls=...): JSON-compatible (json writes it as a list)."""

    start: int
    stop: int
    label: str = ""


@dataclass
class Window:
    """A dataclass whose field is annotated with a NamedTuple."""

    span: Span
    spans: list[Span] = field(default_factory=list)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------- torch
@clause("TORCH-ROUNDTRIP-1", "TORCH-FILE-1", "LOAD-INPLACE-1")
def test_torch_nested_state_roundtrip(manager_factory: Factory, ckpt_root: Where) -> None:
    value: dict[str, Any] = {
        "w": torch.randn(3, 2, generator=_gen(0)),
        "nested": {"b": torch.arange(4, dtype=torch.int64), "lst": [torch.ones(1), 2, "x"], "tup": (1.5, None)},
        "flag": True,
        "n": 7,
        "name": "abc",
    }
    m = manager_factory({"state": spec(layout=layout("state_{rank}.pt", "TorchSerialization"))})
    save(m, ckpt_root / "c", {"state": value})
    on_disk = torch_load(ckpt_root / "c" / "state_0.pt")
    assert torch.equal(on_disk["w"], value["w"]) and on_disk["nested"]["tup"] == (1.5, None)
    template: dict[str, Any] = {
        "w": torch.zeros(3, 2),
        "nested": {"b": torch.zeros(4, dtype=torch.int64), "lst": [torch.zeros(1), 0, ""], "tup": (0.0, None)},
        "flag": False,
        "n": 0,
        "name": "",
    }
    w_obj = template["w"]
    out = m.load(str(ckpt_root / "c"), into={"state": template})["state"]
    assert out["w"] is w_obj and torch.equal(out["w"], value["w"])
    assert torch.equal(out["nested"]["b"], value["nested"]["b"])
    assert torch.equal(out["nested"]["lst"][0], torch.ones(1)) and out["nested"]["lst"][1:] == [2, "x"]
    assert tuple(out["nested"]["tup"]) == (1.5, None)
    assert (out["flag"], out["n"], out["name"]) == (True, 7, "abc")


@clause("TORCH-OBJECT-1")
def test_torch_arbitrary_picklable_object(manager_factory: Factory, ckpt_root: Where) -> None:
    obj = UserObject("loader", (3, 4))
    m = manager_factory()
    save(m, ckpt_root / "c", {"obj": obj})
    # The format "uses torch.save / torch.load": the file is what torch.save wrote. Reading arbitrary objects
    # back is torch.load's trusted mode (weights_only=False), which torch itself no longer uses by default.
    assert torch_load(ckpt_root / "c" / "obj_0.pt") == obj


# -------------------------------------------------------------------- json
@clause("JSON-ROUNDTRIP-1", "JSON-PRETTY-1")
def test_json_sorted_and_indented(manager_factory: Factory, ckpt_root: Where) -> None:
    value = {"zeta": 1, "alpha": {"y": [1, 2], "b": "s"}, "mid": None, "f": 0.25}
    m = manager_factory({"cfg": spec(layout=layout("cfg.json", "JsonSerialization"))})
    save(m, ckpt_root / "c", {"cfg": value})
    text = read_text(ckpt_root / "c" / "cfg.json")
    assert json.loads(text) == value
    lines = text.splitlines()
    assert len(lines) > 3, "not pretty-printed over several lines"
    assert any(line.startswith((" ", "\t")) for line in lines), "nested lines are not indented"
    top = ["alpha", "f", "mid", "zeta"]
    positions = [text.index(f'"{k}"') for k in top]
    assert positions == sorted(positions), "top-level keys not sorted"
    assert text.index('"b"') < text.index('"y"'), "nested keys not sorted"


@clause("JSON-CLS-1")
@pytest.mark.parametrize("value", [{"a": [1, {"b": 2}]}, [3, "x", None], 42, "text", 2.5], ids=repr)
def test_json_cls_none_returns_raw_json(manager_factory: Factory, ckpt_root: Where, value: Any) -> None:
    fmt = backend.name("checkpoint_layout", "JsonSerialization")()
    assert fmt.cls is None
    m = manager_factory({"v": spec(layout=layout("v.json", "JsonSerialization"))})
    save(m, ckpt_root / "c", {"v": value})
    out = m.load(str(ckpt_root / "c"), into={"v": None})["v"]
    assert out == value and type(out) is type(value)


@clause("JSON-CLS-2")
def test_json_cls_reconstructs_type(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"info": spec(layout=layout("info.json", "JsonSerialization", cls=StepInfo))})
    save(m, ckpt_root / "c", {"info": {"step": 9, "tag": "t"}})
    out = m.load(str(ckpt_root / "c"), into={"info": None})["info"]
    assert isinstance(out, StepInfo)
    assert out == StepInfo(9, "t")


@clause("JSON-CLS-5")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_json_cls_with_a_template_of_that_type(manager_factory: Factory, ckpt_root: Where, mode: str) -> None:
    """The document's full example passes a live template in `into=` for every item, its JSON item included,
    and "when cls is a type, it records the Python type to reconstruct on read": a template that is an
    instance of `cls` is accepted, and the loaded value is a `cls` instance holding the saved fields."""
    m = manager_factory({"info": spec(layout=layout("info.json", "JsonSerialization", cls=StepInfo))}, mode=mode)
    save(m, ckpt_root / "c", {"info": {"step": 9, "tag": "t"}})
    out = m.load(str(ckpt_root / "c"), into={"info": StepInfo(0, "")})["info"]
    assert isinstance(out, StepInfo), f"loaded {out!r}"
    assert out == StepInfo(9, "t")


@clause("JSON-CLS-3")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_json_cls_reconstructs_nested_dataclass_fields(manager_factory: Factory, ckpt_root: Where, mode: str) -> None:
    """ "When cls is a type, it records the Python type to reconstruct on read": a RunInfo whose `bounds` came
    back a dict would not be the recorded type, so the fields typed as dataclasses are rebuilt too."""
    m = manager_factory({"run": spec(layout=layout("run.json", "JsonSerialization", cls=RunInfo))}, mode=mode)
    saved = {
        "bounds": {"low": 1, "high": 2},
        "fallback": {"low": 3, "high": 4},
        "history": [{"low": 5, "high": 6}],
        "pair": [{"low": 7, "high": 8}, 9],
        "seen": [{"low": 10, "high": 11}],
        "named": {"k": {"low": 12, "high": 13}},
    }
    save(m, ckpt_root / "c", {"run": saved})
    out = m.load(str(ckpt_root / "c"), into={"run": None})["run"]
    nested = [out.bounds, out.fallback, out.history[0], out.pair[0], out.seen[0], out.named["k"]]
    assert all(type(x) is Limits for x in nested), f"loaded {out!r}"
    assert nested == [Limits(1, 2), Limits(3, 4), Limits(5, 6), Limits(7, 8), Limits(10, 11), Limits(12, 13)]
    assert out.pair[1] == 9


# (cls, the JSON-compatible value saved, what the load must return). The dataclass is saved in its dict form,
# as in JSON-CLS-2 and JSON-CLS-3: a dict holding NamedTuples is JSON-compatible, a dataclass instance is not.
NAMED_TUPLE_CASES = {
    "namedtuple": (Span, Span(1, 4, "a"), Span(1, 4, "a")),
    "namedtuple-fields": (
        Window,
        {"span": Span(0, 2, "w"), "spans": [Span(2, 3, "x"), Span(3, 5, "y")]},
        Window(Span(0, 2, "w"), [Span(2, 3, "x"), Span(3, 5, "y")]),
    ),
}


@clause("JSON-CLS-4")
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("case", sorted(NAMED_TUPLE_CASES))
def test_json_cls_reconstructs_named_tuples(manager_factory: Factory, ckpt_root: Where, mode: str, case: str) -> None:
    """ "When cls is a type, it records the Python type to reconstruct on read": a NamedTuple is a type, and its
    instances are JSON-compatible data (json writes them as lists), so they load back as that type."""
    cls, saved, expected = NAMED_TUPLE_CASES[case]
    m = manager_factory({"v": spec(layout=layout("v.json", "JsonSerialization", cls=cls))}, mode=mode)
    save(m, ckpt_root / "c", {"v": saved})
    out = m.load(str(ckpt_root / "c"), into={"v": None})["v"]
    assert type(out) is cls and out == expected, f"loaded {out!r}"
    if isinstance(out, Window):
        assert type(out.span) is Span and all(type(s) is Span for s in out.spans), f"loaded {out!r}"


class Opaque:
    """A picklable object that json.dump cannot encode."""


NOT_JSON = {"set": {1, 2}, "tensor": torch.ones(2), "bytes": b"ab", "object": Opaque()}


@clause("JSON-COMPAT-1")
@pytest.mark.parametrize("case", sorted(NOT_JSON))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_json_rejects_unencodable_values(manager_factory: Factory, ckpt_root: Where, case: str, mode: str) -> None:
    """ "Serializes JSON-compatible data with json.dump": a value json.dump cannot encode fails the write (from
    save() or its Future) rather than being written in some other encoding (its str(), a pickle). The type is
    not named by the document, so any exception counts."""
    m = manager_factory({"cfg": spec(layout=layout("cfg.json", "JsonSerialization"))}, mode=mode)
    with pytest.raises(Exception):
        save(m, ckpt_root / "c", {"cfg": {"ok": 1, "bad": NOT_JSON[case]}})


# --------------------------------------------------------------------- raw
@clause("RAW-BYTES-1")
def test_raw_bytes_as_is(manager_factory: Factory, ckpt_root: Where) -> None:
    blob = bytes(range(256)) + b'{"already": "json"}\n'
    m = manager_factory({"blob": spec(layout=layout("blob.bin", "RawSerialization"))})
    save(m, ckpt_root / "c", {"blob": blob})
    assert read_bytes(ckpt_root / "c" / "blob.bin") == blob
    out = m.load(str(ckpt_root / "c"), into={"blob": None})["blob"]
    assert out == blob and isinstance(out, bytes)


NOT_BYTES = ["text", bytearray(b"abc"), 5, {"a": 1}]


@clause("RAW-TYPE-1")
@pytest.mark.parametrize("value", NOT_BYTES, ids=repr)
def test_raw_rejects_non_bytes_sync(manager_factory: Factory, ckpt_root: Where, value: Any) -> None:
    m = manager_factory({"blob": spec(layout=layout("blob.bin", "RawSerialization"))})
    with pytest.raises(ValueError):
        save(m, ckpt_root / "c", {"blob": value})


@clause("RAW-TYPE-2")
def test_raw_rejects_non_bytes_async(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory(
        {"blob": spec(requires_copy=False, layout=layout("blob.bin", "RawSerialization"))}, mode="async"
    )
    with pytest.raises(ValueError):
        save(m, ckpt_root / "c", {"blob": "not bytes"})


# ------------------------------------------------------------- safetensors
def _st(metadata: dict[str, str] | None = None, path: str = "m.safetensors") -> Any:
    return spec(layout=layout(path, "SafetensorsSerialization", metadata=metadata))


@clause("ST-FILE-1", "ST-FLATTEN-1", "ST-META-2")
def test_safetensors_flattens_to_dotted_keys(manager_factory: Factory, ckpt_root: Where) -> None:
    t = [torch.randn(2, 2, generator=_gen(i)) for i in range(5)]
    value = {"a": {"b": t[0]}, "c": [t[1], t[2]], "d": (t[3],), "e": t[4]}
    m = manager_factory({"m": _st()})
    save(m, ckpt_root / "c", {"m": value})
    flat = st_load(read_bytes(ckpt_root / "c" / "m.safetensors"))
    assert set(flat) == {"a.b", "c.0", "c.1", "d.0", "e"}
    for k, ref in zip(("a.b", "c.0", "c.1", "d.0", "e"), t, strict=False):
        assert torch.equal(flat[k], ref), k


@clause("ST-RENEST-1", "LOAD-INPLACE-1")
def test_safetensors_renests_into_template(manager_factory: Factory, ckpt_root: Where) -> None:
    value: dict[str, Any] = {
        "layer": {"w": torch.randn(3, generator=_gen(1)), "b": torch.randn(1, generator=_gen(2))},
        "stack": [torch.ones(2), torch.zeros(2)],
    }
    m = manager_factory({"m": _st()})
    save(m, ckpt_root / "c", {"m": value})
    template: dict[str, Any] = {
        "layer": {"w": torch.empty(3), "b": torch.empty(1)},
        "stack": [torch.empty(2), torch.empty(2)],
    }
    w_obj = template["layer"]["w"]
    out = m.load(str(ckpt_root / "c"), into={"m": template})["m"]
    assert out["layer"]["w"] is w_obj
    assert torch.equal(out["layer"]["w"], value["layer"]["w"]) and torch.equal(out["layer"]["b"], value["layer"]["b"])
    assert torch.equal(out["stack"][0], torch.ones(2)) and torch.equal(out["stack"][1], torch.zeros(2))


@clause("ST-RENEST-2")
def test_safetensors_renests_tuples_and_bare_tensors(manager_factory: Factory, ckpt_root: Where) -> None:
    """ "re-nests the flat keys back to the target's structure so the value round-trips": a tuple parent in the
    template comes back a tuple, and an item whose value is one tensor (nothing to flatten) comes back a tensor."""
    t = [torch.randn(3, generator=_gen(i)) for i in range(3)]
    m = manager_factory({"m": _st(), "w": _st(path="w.safetensors")})
    save(m, ckpt_root / "c", {"m": {"pair": (t[0], t[1])}, "w": t[2]})
    out = m.load(str(ckpt_root / "c"), into={"m": {"pair": (torch.empty(3), torch.empty(3))}, "w": torch.empty(3)})
    assert type(out["m"]["pair"]) is tuple, f"tuple parent came back as {type(out['m']['pair']).__name__}"
    assert torch.equal(out["m"]["pair"][0], t[0]) and torch.equal(out["m"]["pair"][1], t[1])
    assert isinstance(out["w"], torch.Tensor) and torch.equal(out["w"], t[2])


@clause("ST-SHARED-1")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_safetensors_saves_tensors_sharing_storage(manager_factory: Factory, ckpt_root: Where, mode: str) -> None:
    """Tensor leaves are what the format supports ("non-tensor leaf values are not supported" is its only
    refusal), and a state dict's tensor leaves often share storage: tied weights (one tensor under two keys)
    and views of one buffer. Each leaf is written and loads back its own values."""
    base = torch.randn(4, 3, generator=_gen(7))
    value = {"emb": base, "head": base, "rows": [base[0], base[2:]], "col": base[:, 1]}
    m = manager_factory({"m": _st()}, mode=mode)
    save(m, ckpt_root / "c", {"m": value})
    template = {"emb": torch.empty(4, 3), "head": torch.empty(4, 3), "rows": [torch.empty(3), torch.empty(2, 3)]}
    out = m.load(str(ckpt_root / "c"), into={"m": {**template, "col": torch.empty(4)}})["m"]
    assert torch.equal(out["emb"], base) and torch.equal(out["head"], base)
    assert torch.equal(out["rows"][0], base[0]) and torch.equal(out["rows"][1], base[2:])
    assert torch.equal(out["col"], base[:, 1])


@clause("ST-TENSORONLY-1")
@pytest.mark.parametrize("leaf", [3, "s", None, 1.5], ids=repr)
def test_safetensors_rejects_non_tensor_leaves(manager_factory: Factory, ckpt_root: Where, leaf: Any) -> None:
    m = manager_factory({"m": _st()})
    with pytest.raises(ValueError):
        save(m, ckpt_root / "c", {"m": {"w": torch.ones(1), "x": leaf}})


@clause("ST-TENSORONLY-2")
@pytest.mark.parametrize("leaf", [3, "s"], ids=repr)
def test_safetensors_rejects_non_tensor_leaves_async(manager_factory: Factory, ckpt_root: Where, leaf: Any) -> None:
    """The same ValueError "on write" when the write is async: from save() or from the write Future."""
    m = manager_factory({"m": _st()}, mode="async")
    with pytest.raises(ValueError):
        save(m, ckpt_root / "c", {"m": {"w": torch.ones(1), "x": leaf}})


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a nested dict / list, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    children = value.values() if isinstance(value, dict) else value
    return [t for child in children for t in _leaves(child)]


def _zeros_like(value: Any) -> Any:
    """A template of the same structure with zero tensors."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _zeros_like(v) for k, v in value.items()}
    return [_zeros_like(v) for v in value]


@clause("ST-FLATTEN-2")
@pytest.mark.parametrize(
    "value",
    [
        {"a.b": torch.full((2,), 1.0), "a": {"b": torch.full((2,), 2.0)}},
        {"l": [torch.full((2,), 1.0)], "l.0": torch.full((2,), 2.0)},
        {0: torch.full((2,), 1.0), "0": torch.full((2,), 2.0)},
    ],
    ids=["dotted-key-vs-nested", "dotted-key-vs-list-index", "int-key-vs-str-key"],
)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_safetensors_flatten_never_merges_two_leaves(
    manager_factory: Factory, ckpt_root: Where, value: Any, mode: str
) -> None:
    """Flattening to dot-separated keys must keep "the value round-trips": two leaves whose dotted keys
    coincide are not merged into one. The write raises, or each leaf loads back its own tensor."""
    m = manager_factory({"m": _st()}, mode=mode)
    try:
        save(m, ckpt_root / "c", {"m": value})
    except Exception:
        return  # refused: nothing merged
    out = m.load(str(ckpt_root / "c"), into={"m": _zeros_like(value)})["m"]
    saved, loaded = _leaves(value), _leaves(out)
    assert len(loaded) == len(saved)
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved, strict=True)), "two leaves were merged"


@clause("ST-MISSING-1")
def test_safetensors_missing_dict_leaf(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"m": _st()})
    save(m, ckpt_root / "c", {"m": {"a": torch.full((2,), 1.0), "c": torch.full((2,), 3.0)}})
    sentinel = torch.full((2,), -7.0)
    template = {"a": torch.zeros(2), "b": sentinel, "c": torch.zeros(2)}
    out = m.load(str(ckpt_root / "c"), into={"m": template}, strict=False)["m"]
    assert torch.equal(out["a"], torch.full((2,), 1.0)) and torch.equal(out["c"], torch.full((2,), 3.0))
    assert torch.equal(sentinel, torch.full((2,), -7.0)), "missing leaf overwritten with other data"
    if "b" in out:
        assert torch.equal(out["b"], torch.full((2,), -7.0)), "missing leaf misaligned"
    strict_template = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)}
    with pytest.raises(Exception):
        m.load(str(ckpt_root / "c"), into={"m": strict_template}, strict=True)


@clause("ST-MISSING-2")
@pytest.mark.parametrize("container", [list, tuple])
def test_safetensors_missing_sequence_leaf_is_none(manager_factory: Factory, ckpt_root: Where, container: type) -> None:
    m = manager_factory({"m": _st()})
    save(m, ckpt_root / "c", {"m": {"seq": container([torch.full((2,), 1.0)])}})
    template = {"seq": container([torch.zeros(2), torch.zeros(2)])}
    out = m.load(str(ckpt_root / "c"), into={"m": template}, strict=False)["m"]
    assert torch.equal(out["seq"][0], torch.full((2,), 1.0))
    assert out["seq"][1] is None


@clause("ST-CONTIG-1")
def test_safetensors_non_contiguous(manager_factory: Factory, ckpt_root: Where) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    value = {"t": base.t(), "s": base[:, ::2]}
    assert not value["t"].is_contiguous() and not value["s"].is_contiguous()
    m = manager_factory({"m": _st()})
    save(m, ckpt_root / "c", {"m": value})
    flat = st_load(read_bytes(ckpt_root / "c" / "m.safetensors"))
    assert torch.equal(flat["t"], base.t()) and torch.equal(flat["s"], base[:, ::2])
    out = m.load(str(ckpt_root / "c"), into={"m": {"t": torch.zeros(4, 3), "s": torch.zeros(3, 2)}})["m"]
    assert torch.equal(out["t"], base.t()) and torch.equal(out["s"], base[:, ::2])


@clause("ST-META-1")
def test_safetensors_metadata_in_header(manager_factory: Factory, ckpt_root: Where) -> None:
    meta = {"format_version": "1", "note": "hello"}
    m = manager_factory({"m": _st(metadata=meta, path="model_state.safetensors")})
    save(m, ckpt_root / "c", {"m": {"w": torch.ones(2)}})
    with safe_open(str(local_file(ckpt_root / "c" / "model_state.safetensors")), framework="pt") as fh:
        header = fh.metadata() or {}
    assert {k: header.get(k) for k in meta} == meta


@clause("ST-META-3")
@pytest.mark.parametrize("meta", [{"v": 1}, {1: "v"}, {"v": None}], ids=repr)
def test_safetensors_metadata_must_be_str(manager_factory: Factory, ckpt_root: Where, meta: Any) -> None:
    with pytest.raises(Exception):
        m = manager_factory({"m": _st(metadata=meta)})
        save(m, ckpt_root / "c", {"m": {"w": torch.ones(2)}})


# ---------------------------------------------------------- custom formats
@clause("FORMAT-CUSTOM-1")
def test_custom_format_is_not_supported(manager_factory: Factory, ckpt_root: Where) -> None:
    base = backend.name("checkpoint_layout", "SerializationFormat")
    members = {name: (lambda *a, **k: {"type": "Custom"}) for name in getattr(base, "__abstractmethods__", ())}
    custom = type("CustomFormat", (base,), members)
    fmt = custom()
    li = backend.name("checkpoint_layout", "LayoutInfo")("custom.bin", fmt)
    m = manager_factory({"x": spec(layout=li)})
    with pytest.raises(Exception):
        save(m, ckpt_root / "c", {"x": {"w": torch.ones(1)}})
    assert "custom.bin" not in files(ckpt_root / "c")
