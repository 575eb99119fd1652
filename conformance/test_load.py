"""Load templates, single-process resharder clauses, and the document's first example."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from conformance import backend
from conformance.helpers import WRITE_TIMEOUT_S, Where, files, layout, raised_by, save, spec

clause = pytest.mark.clause
Factory = Callable[..., Any]


@clause("LOAD-INPLACE-1", "LOAD-RETURN-1")
def test_templates_filled_in_place(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory()
    saved = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(3)), "b": torch.ones(3)}
    save(m, ckpt_root / "c", {"model": saved, "misc_state": {"step": 12}, "step": 5})
    template = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    ids = {k: id(v) for k, v in template.items()}
    out = m.load(str(ckpt_root / "c"), into={"model": template, "misc_state": {"step": 0}, "step": 0})
    for k in saved:
        assert id(out["model"][k]) == ids[k], f"{k}: template identity lost"
        assert torch.equal(template[k], saved[k]), f"{k}: template not filled in place"
    assert out["misc_state"]["step"] == 12
    assert out["step"] == 5


Pairs = list[tuple[torch.Tensor, torch.Tensor]]


def _inplace_case(case: str) -> tuple[dict[str, Any], Any, Any, Pairs]:
    """(items, saved value, `into=` template, [(template tensor, its saved value)]) for one LOAD-INPLACE-2 case."""
    v = [torch.randn(3, 2, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    z = [torch.zeros(3, 2) for _ in range(3)]
    if case in ("bare-torch", "bare-safetensors"):
        fmt = "TorchSerialization" if case == "bare-torch" else "SafetensorsSerialization"
        return {"m": spec(layout=layout("m_{rank}.bin", fmt))}, v[0], z[0], [(z[0], v[0])]
    if case == "list-tuple":
        pairs = [(z[0], v[0]), (z[1], v[1]), (z[2], v[2])]
        return {"m": spec()}, {"l": [v[0], v[1]], "t": (v[2],)}, {"l": [z[0], z[1]], "t": (z[2],)}, pairs
    if case == "non-contiguous":
        t = torch.zeros(2, 3).t()  # a transposed view, as a tied or channels-last weight is
        return {"m": spec()}, {"w": v[0]}, {"w": t}, [(t, v[0])]
    resharder = backend.name("dtensor_resharder", "DTensorResharder")()
    pairs = [(z[0], v[0]), (z[1], v[1])]
    return {"m": spec(resharder=resharder)}, {"w": v[0], "b": v[1]}, {"w": z[0], "b": z[1]}, pairs


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    return [t for v in value for t in _tensors_of(v)]


@clause("LOAD-INPLACE-2")
@pytest.mark.parametrize("case", ["bare-torch", "bare-safetensors", "list-tuple", "non-contiguous", "resharder"])
def test_every_template_tensor_filled_in_place(manager_factory: Factory, ckpt_root: Where, case: str) -> None:
    """ "Tensors in the into= templates are copied in place (identity preserved)" names no exception: a tensor
    that is the whole item (torch and safetensors files), tensors inside lists and tuples, a non-contiguous
    template, and an item that declares a resharder on an unchanged layout all come back as the template
    objects, holding the saved values."""
    items, saved, template, pairs = _inplace_case(case)
    m = manager_factory(items)
    save(m, ckpt_root / "c", {"m": saved})
    got = _tensors_of(m.load(str(ckpt_root / "c"), into={"m": template})["m"])
    for i, (obj, value) in enumerate(pairs):
        assert any(g is obj for g in got), f"template tensor {i}: identity lost"
        assert torch.equal(obj, value), f"template tensor {i} does not hold the saved values"


@clause("LOAD-MODULE-1")
def test_module_restored_without_load_state_dict(manager_factory: Factory, ckpt_root: Where) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    reference = {k: v.clone() for k, v in net.state_dict().items()}
    m = manager_factory({"model": spec()})
    save(m, ckpt_root / "c", {"model": net.state_dict()})
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(0.5)
    m.load(str(ckpt_root / "c"), into={"model": net.state_dict()})
    for k, v in net.state_dict().items():
        assert torch.equal(v, reference[k]), k


@clause("LOAD-FILTER-1")
def test_returned_mapping_has_the_requested_items(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory()
    save(m, ckpt_root / "c", {"model": torch.ones(2), "optimizer": torch.zeros(2), "step": 3})
    out = m.load(str(ckpt_root / "c"), into={"model": torch.empty(2), "step": 0})
    assert set(out.keys()) == {"model", "step"}
    assert torch.equal(out["model"], torch.ones(2)) and out["step"] == 3


def _last_line(exc: BaseException) -> str:
    """The exception's type and the last line of its message (a writer's traceback text ends with the error)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1][:200] if lines else ''}"


# 16 MiB per item: large enough that an async write is still running when load() is called.
AFTER_SAVE_NUMEL = 1 << 22


@clause("LOAD-AFTERSAVE-1")
@pytest.mark.parametrize("target", ["fresh-id", "committed-id"])
def test_load_right_after_an_async_save(manager_factory: Factory, ckpt_root: Where, target: str) -> None:
    """The document saves and then loads the same path on an async-by-default manager with nothing between
    ("manager.save(path, ...)" then "manager.load(path, into=...)"): the load restores what that save saved,
    whether the id was new or held an earlier checkpoint."""
    m = manager_factory({"model": spec()}, mode="async")
    path = ckpt_root / "c"
    if target == "committed-id":
        save(m, path, {"model": {"w": torch.zeros(AFTER_SAVE_NUMEL), "b": torch.zeros(3)}})
    saved = {"w": torch.arange(AFTER_SAVE_NUMEL, dtype=torch.float32), "b": torch.full((3,), 7.0)}
    try:
        pending = m.save(str(path), {"model": saved})
    except Exception as exc:  # replacing a checkpoint is the backend's choice
        if target == "committed-id":
            pytest.skip(f"not measured: the save over a committed id failed ({_last_line(exc)})")
        raise
    template = {"w": torch.empty(AFTER_SAVE_NUMEL), "b": torch.empty(3)}
    error = raised_by(m.load, str(path), into={"model": template})
    refused = raised_by(pending.result, timeout=WRITE_TIMEOUT_S) if isinstance(pending, Future) else None
    if refused is not None and target == "committed-id":  # replacing a checkpoint is the backend's choice
        pytest.skip(f"not measured: the save over a committed id failed ({_last_line(refused)})")
    assert refused is None, f"the save failed: {refused!r}"
    assert error is None, f"load() right after save() of the same id raised {error!r}"
    assert torch.equal(template["b"], saved["b"]) and torch.equal(template["w"], saved["w"]), (
        "load() right after save() of the same id did not restore what that save saved"
    )


@clause("RESHARD-CTOR-1")
def test_dtensor_resharder_takes_no_arguments() -> None:
    cls = backend.name("dtensor_resharder", "DTensorResharder")
    assert isinstance(cls(), backend.name("resharding", "Resharder"))
    with pytest.raises(TypeError):
        cls(1)


class _Complete:
    """Mixin body for a minimal custom resharder (both abstract methods implemented)."""

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[Any, Any]:
        return {}

    def load(
        self, source_path: Any, item_key: str, target_metadata: Any, source_metadata: Any, target: Any, storage: Any
    ) -> list[Any]:
        return []


@clause("RESHARD-ABC-1")
def test_resharder_has_two_abstract_methods(manager_factory: Factory, ckpt_root: Where) -> None:
    base = backend.name("resharding", "Resharder")
    assert set(getattr(base, "__abstractmethods__", ())) == {"extract_sharding_metadata", "load"}
    with pytest.raises(TypeError):
        type("OnlyExtract", (base,), {"extract_sharding_metadata": _Complete.extract_sharding_metadata})()
    custom = type("Complete", (base,), dict(_Complete.__dict__))()
    m = manager_factory({"loader": spec(requires_copy=False, resharder=custom)})
    save(m, ckpt_root / "c", {"loader": {"pos": 4}})
    assert m.load(str(ckpt_root / "c"), into={"loader": {"pos": 0}})["loader"]["pos"] == 4


# The parameters of the two abstract methods, as the document's custom resharder declares them.
RESHARDER_SIGNATURES = {
    "extract_sharding_metadata": ["self", "item_key", "item_value"],
    "load": ["self", "source_path", "item_key", "target_metadata", "source_metadata", "target", "storage"],
}


@clause("RESHARD-SIG-1")
@pytest.mark.parametrize("method", sorted(RESHARDER_SIGNATURES))
def test_resharder_abstract_method_parameters(method: str) -> None:
    base = backend.name("resharding", "Resharder")
    params = list(inspect.signature(getattr(base, method)).parameters)
    assert params == RESHARDER_SIGNATURES[method]


@clause("RESHARD-AUTO-1")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_declaring_a_resharder_is_enough(manager_factory: Factory, ckpt_root: Where, mode: str) -> None:
    resharder = backend.name("dtensor_resharder", "DTensorResharder")
    m = manager_factory({"model": spec(resharder=resharder())}, mode=mode)
    sd = {"w": torch.arange(6.0).reshape(2, 3)}
    save(m, ckpt_root / "c", {"model": sd})
    assert "model_0.pt" in files(ckpt_root / "c")
    out = m.load(str(ckpt_root / "c"), into={"model": {"w": torch.zeros(2, 3)}})
    assert torch.equal(out["model"]["w"], sd["w"])


@clause("CONFIG-DEFAULT-5")
def test_default_resharder_is_wired_for_unlisted_keys(manager_factory: Factory, ckpt_root: Where) -> None:
    """ "Config.default is the spec applied to any key not listed there", and "when an item declares a resharder,
    the manager auto-wires the sharding-metadata pipeline on both save and load": an un-listed key under a
    default with a resharder has its metadata extracted from the saved value and from the `into=` value."""
    from conformance import custom_resharder

    m = manager_factory({"model": spec()}, default=spec(resharder=custom_resharder.DataloaderResharder()))
    custom_resharder.CALLS.clear()
    save(m, ckpt_root / "c", {"model": torch.ones(2), "loader": {"position": 7}})
    on_save = [(c["item_key"], c["position"]) for c in custom_resharder.CALLS if c["call"] == "extract"]
    assert on_save == [("loader", 7)], f"metadata extracted on save: {on_save}"
    custom_resharder.CALLS.clear()
    m.load(str(ckpt_root / "c"), into={"model": torch.zeros(2), "loader": {"position": 0}})
    on_load = [(c["item_key"], c["position"]) for c in custom_resharder.CALLS if c["call"] == "extract"]
    assert on_load == [("loader", 0)], f"metadata extracted on load: {on_load}"


@clause("RESHARD-AUTO-3")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_save_and_load_runs_the_pipeline(manager_factory: Factory, ckpt_root: Where, mode: str) -> None:
    """The manager records "the source metadata on save and the target metadata on load": on every save and
    every load, not only its first. Two checkpoints saved by one manager as two chunks each are loaded by
    another manager into one chunk, each of them twice; every load must go through the resharder."""
    from conformance import custom_resharder

    def items() -> dict[str, Any]:
        return {"loader": spec(requires_copy=False, resharder=custom_resharder.ChunkResharder())}

    writer = manager_factory(items(), mode=mode)
    saved = {name: torch.arange(6.0) + 10 * i for i, name in enumerate(("first", "second"))}
    for name, value in saved.items():
        save(writer, ckpt_root / name, {"loader": {"chunks": list(value.clone().chunk(2))}})
    reader = manager_factory(items())
    for attempt, name in enumerate(("second", "first", "second")):
        custom_resharder.CALLS.clear()
        target = {"chunks": [torch.zeros(6)]}
        error = raised_by(reader.load, str(ckpt_root / name), into={"loader": target})
        assert error is None, f"load #{attempt + 1} of the reader ({name!r}, the writer's {name} save) raised {error!r}"
        resharded = [c for c in custom_resharder.CALLS if c["call"] == "chunk-load"]
        assert resharded, f"load #{attempt + 1} of the reader ({name!r}) did not run the resharder"
        assert torch.equal(target["chunks"][0], saved[name]), f"load #{attempt + 1} ({name!r}) restored wrong values"


@clause("RESHARD-AUTO-4")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_save_records_its_own_value(manager_factory: Factory, ckpt_root: Where, mode: str) -> None:
    """ "Declare configuration once and pass plain dicts every save", with the source metadata recorded "on
    save": a resharder item whose value changes between saves of one manager (a tensor grows, then gains a
    column; an entry appears) is saved each time, and each checkpoint loads back its own value."""
    resharder = backend.name("dtensor_resharder", "DTensorResharder")
    m = manager_factory({"model": spec(resharder=resharder())}, mode=mode)
    shapes = [(2, 3), (4, 3), (4, 5)]

    def value(step: int, fill: float) -> dict[str, torch.Tensor]:
        extra = {"new": torch.full((step,), fill)} if step else {}
        return {"emb": torch.full(shapes[step], fill), **extra}

    for step in range(len(shapes)):
        error = raised_by(save, m, ckpt_root / f"s{step}", {"model": value(step, float(step + 1))})
        assert error is None, f"save {step} (shapes {shapes[: step + 1]}) raised {error!r}"
    for step in range(len(shapes)):
        out = m.load(str(ckpt_root / f"s{step}"), into={"model": value(step, 0.0)})["model"]
        want = value(step, float(step + 1))
        assert sorted(out) == sorted(want), f"checkpoint {step}: loaded entries {sorted(out)}, saved {sorted(want)}"
        for name, got in out.items():
            assert torch.equal(got, want[name]), f"checkpoint {step}: {name} differs"


# A resharder item on a layout of its own: a {rank} path in a subdirectory, and a safetensors file.
RESHARD_LAYOUTS = {
    "torch-subdir": ("shards/model_{rank}.pt", "TorchSerialization", "shards/model_0.pt"),
    "safetensors": ("model_{rank}.safetensors", "SafetensorsSerialization", "model_0.safetensors"),
}


@clause("RESHARD-LAYOUT-1")
@pytest.mark.parametrize("case", sorted(RESHARD_LAYOUTS))
def test_resharder_with_a_custom_layout(manager_factory: Factory, ckpt_root: Where, case: str) -> None:
    """An ItemSpec carries "where it lands on disk, and how it is resharded on load" as separate fields, and
    "declaring the resharder is the whole contract": a DTensorResharder item with its own layout is written to
    that layout's file and loads back on an unchanged layout."""
    path, fmt, written = RESHARD_LAYOUTS[case]
    resharder = backend.name("dtensor_resharder", "DTensorResharder")
    m = manager_factory({"model": spec(resharder=resharder(), layout=layout(path, fmt))})
    sd = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    save(m, ckpt_root / "c", {"model": sd})
    assert written in files(ckpt_root / "c")
    out = m.load(str(ckpt_root / "c"), into={"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}})
    assert torch.equal(out["model"]["w"], sd["w"]) and torch.equal(out["model"]["b"], sd["b"])


@clause("EXAMPLE-DEFAULTS-1")
@pytest.mark.local_only(
    "the clause is about the defaults on the local filesystem the suite runs on (CLAUSES.md, Storage): the first "
    "example configures no storage, and the document promises nothing about a URL id without one"
)
def test_first_example_with_defaults(tmp_path: Path) -> None:
    top = backend.module()
    manager = top.CheckpointManager(
        top.CheckpointManager.Config(
            items={"dataloader": top.ItemSpec(requires_copy=False)},
        )
    )
    try:
        payload = {"model": {"w": torch.ones(3)}, "step": 4, "dataloader": {"pos": 9}}
        save(manager, tmp_path / "c", payload)
        out = manager.load(str(tmp_path / "c"), into={"model": {"w": torch.zeros(3)}, "step": 0, "dataloader": None})
        assert torch.equal(out["model"]["w"], torch.ones(3))
        assert out["step"] == 4 and out["dataloader"] == {"pos": 9}
    finally:
        manager.close()
