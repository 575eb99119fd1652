"""ItemSpec, Config.items / default / strict, key rules, required items, import locations."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conformance import backend
from conformance.helpers import Where, files, layout, save, spec, torch_save

clause = pytest.mark.clause
Factory = Callable[..., Any]


# --------------------------------------------------------------------- ItemSpec
@clause("SPEC-FIELDS-1")
def test_itemspec_is_a_dataclass_with_four_fields() -> None:
    item_spec = backend.name("", "ItemSpec")
    assert dataclasses.is_dataclass(item_spec)
    assert [f.name for f in dataclasses.fields(item_spec)] == ["requires_copy", "layout", "resharder", "required"]


@clause("SPEC-DEFAULTS-1")
def test_itemspec_defaults() -> None:
    s = backend.name("", "ItemSpec")()
    assert (s.requires_copy, s.layout, s.resharder, s.required) == (True, None, None, True)


# ------------------------------------------------------------------------ Config
@clause("CONFIG-ITEMS-1")
def test_items_spec_overlays_the_payload_value(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"meta": spec(layout=layout("meta_file.json", "JsonSerialization"))})
    save(m, ckpt_root / "c", {"meta": {"step": 3}, "other": torch.ones(2)})
    assert "meta_file.json" in files(ckpt_root / "c")
    assert "meta_0.pt" not in files(ckpt_root / "c")
    assert m.load(str(ckpt_root / "c"), into={"meta": None})["meta"] == {"step": 3}


@clause("CONFIG-DEFAULT-1")
def test_unlisted_keys_fall_back_to_config_default(manager_factory: Factory, ckpt_root: Where) -> None:
    default = spec(layout=layout("fallback_{rank}.json", "JsonSerialization"))
    m = manager_factory({"listed": spec()}, default=default)
    save(m, ckpt_root / "c", {"listed": torch.zeros(1), "unlisted": {"a": 1}})
    written = files(ckpt_root / "c")
    assert {"listed_0.pt", "fallback_0.json"} <= written
    assert "unlisted_0.pt" not in written
    out = m.load(str(ckpt_root / "c"), into={"listed": torch.ones(1), "unlisted": None})
    assert out["unlisted"] == {"a": 1}


@clause("CONFIG-DEFAULT-2")
def test_bare_payload_without_schema(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory()
    w = torch.arange(6.0).reshape(2, 3)
    save(m, ckpt_root / "c", {"model": {"w": w}, "step": 7})
    out = m.load(str(ckpt_root / "c"), into={"model": {"w": torch.zeros(2, 3)}, "step": 0})
    assert torch.equal(out["model"]["w"], w)
    assert out["step"] == 7


@clause("CONFIG-STRICT-1")
def test_strict_config_rejects_unlisted_key_on_save(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"model": spec()}, default=None)
    with pytest.raises(Exception):
        save(m, ckpt_root / "bad", {"model": torch.ones(1), "stray": 1})
    save(m, ckpt_root / "good", {"model": torch.ones(1)})
    assert "model_0.pt" in files(ckpt_root / "good")


@clause("CONFIG-STRICT-2")
def test_strict_config_rejects_unlisted_key_on_load(manager_factory: Factory, ckpt_root: Where) -> None:
    """The document: "Set default=None to make the config strict — an un-listed key then raises instead of
    falling back to defaults." The checkpoint holds "stray" (saved by a non-strict manager), so a reader that
    fell back to the default spec would load it: only the strict rule can fail the load, not a missing item."""
    writer = manager_factory()
    save(writer, ckpt_root / "c", {"model": torch.ones(1), "stray": torch.tensor([2.0])})
    m = manager_factory({"model": spec()}, default=None)
    assert torch.equal(m.load(str(ckpt_root / "c"), into={"model": torch.zeros(1)})["model"], torch.ones(1))
    with pytest.raises(Exception):
        m.load(str(ckpt_root / "c"), into={"model": torch.zeros(1), "stray": torch.zeros(1)})


@clause("CONFIG-REUSE-1")
def test_one_schema_many_payloads(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"misc": spec(layout=layout("misc_{rank}.json", "JsonSerialization"))})
    for step in (1, 2, 3):
        save(m, ckpt_root / f"s{step}", {"misc": {"step": step}, "w": torch.full((2,), float(step))})
    for step in (1, 2, 3):
        out = m.load(str(ckpt_root / f"s{step}"), into={"misc": None, "w": torch.zeros(2)})
        assert out["misc"] == {"step": step}
        assert torch.equal(out["w"], torch.full((2,), float(step)))


@clause("CONFIG-DEFAULT-3")
def test_default_required_false_applies_to_unlisted_keys(manager_factory: Factory, ckpt_root: Where) -> None:
    """ "Config.default is the spec applied to any key not listed there": all of it, `required` included. An
    un-listed key is in `into=` by construction, so `required=False` can only mean "may be absent from the
    checkpoint" for it."""
    writer = manager_factory({"model": spec()})
    save(writer, ckpt_root / "c", {"model": torch.full((2,), 4.0)})
    reader = manager_factory({"model": spec()}, default=spec(required=False))
    out = reader.load(str(ckpt_root / "c"), into={"model": torch.zeros(2), "extra": None})
    assert torch.equal(out["model"], torch.full((2,), 4.0))


# --------------------------------------------------------------------------- keys
GOOD_KEYS = ["model", "Model-State_2", "x", "0", "a-b_c-D"]
BAD_KEYS = ["model.pt", "a.b", "a/b", "a b", "tab\tkey", "trailing\n", "", "caf\u00e9", "a$", "a:b", "x*"]


@clause("KEY-CHARSET-1")
@pytest.mark.parametrize("key", GOOD_KEYS)
def test_valid_keys_are_accepted(manager_factory: Factory, ckpt_root: Where, key: str) -> None:
    m = manager_factory()
    save(m, ckpt_root / "c", {key: torch.tensor([1.0])})
    assert f"{key}_0.pt" in files(ckpt_root / "c")
    assert torch.equal(m.load(str(ckpt_root / "c"), into={key: torch.zeros(1)})[key], torch.tensor([1.0]))


@clause("KEY-CHARSET-2")
@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_invalid_keys_are_rejected_on_save(manager_factory: Factory, ckpt_root: Where, key: str) -> None:
    m = manager_factory()
    with pytest.raises(Exception):
        save(m, ckpt_root / "c", {key: torch.tensor([1.0])})


@clause("KEY-CHARSET-3")
@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_invalid_keys_are_rejected_on_load(manager_factory: Factory, ckpt_root: Where, key: str) -> None:
    m = manager_factory()
    save(m, ckpt_root / "c", {"ok": torch.tensor([1.0])})
    # Plant the file the default layout would name, so that only the key rule can fail the load.
    try:
        torch_save(torch.tensor([2.0]), ckpt_root / "c" / f"{key}_0.pt")
    except OSError as exc:  # a store may refuse the name (moto's server: a trailing newline); other keys measure it
        if isinstance(ckpt_root, Path):
            raise
        pytest.skip(f"the store refused an object named {key + '_0.pt'!r} ({exc}), so the planted file is missing")
    with pytest.raises(Exception):
        m.load(str(ckpt_root / "c"), into={"ok": torch.zeros(1), key: torch.zeros(1)})


@clause("KEY-NESTED-1")
def test_nested_keys_are_not_item_keys(manager_factory: Factory, ckpt_root: Where) -> None:
    sd = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)).state_dict()
    assert any("." in k for k in sd)
    m = manager_factory()
    save(m, ckpt_root / "c", {"model": sd, "misc": {"a.b/c d": 1}})
    out = m.load(str(ckpt_root / "c"), into={"model": {k: torch.zeros_like(v) for k, v in sd.items()}, "misc": None})
    assert set(out["model"]) == set(sd)
    assert all(torch.equal(out["model"][k], v) for k, v in sd.items())
    assert out["misc"] == {"a.b/c d": 1}


# ----------------------------------------------------------------------- required
@clause("REQUIRED-SAVE-1")
def test_missing_required_item_fails_save(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"model": spec(), "optim": spec(required=True)})
    with pytest.raises(Exception):
        save(m, ckpt_root / "c", {"model": torch.ones(1)})


@clause("REQUIRED-SAVE-2")
def test_optional_item_may_be_absent_on_save(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"model": spec(), "extra": spec(required=False)})
    save(m, ckpt_root / "c", {"model": torch.ones(1)})
    assert "model_0.pt" in files(ckpt_root / "c")
    assert "extra_0.pt" not in files(ckpt_root / "c")


@clause("REQUIRED-SAVE-3")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_missing_required_item_fails_fast_on_save(manager_factory: Factory, ckpt_root: Where, mode: str) -> None:
    """ "With the default (True), a missing item fails fast": the save() call itself raises (an async save does
    not hand back a Future that fails later) and nothing is written at the id."""
    m = manager_factory({"model": spec(), "optim": spec()}, mode=mode)
    with pytest.raises(Exception):
        m.save(str(ckpt_root / "c"), {"model": torch.ones(1)})
    assert not files(ckpt_root / "c")


@clause("REQUIRED-LOAD-1")
def test_required_item_absent_from_checkpoint_fails_load(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory()
    save(m, ckpt_root / "c", {"model": torch.ones(1)})
    with pytest.raises(Exception):
        m.load(str(ckpt_root / "c"), into={"model": torch.zeros(1), "ghost": None})


@clause("REQUIRED-LOAD-4")
def test_missing_required_item_fails_load_before_filling_templates(manager_factory: Factory, ckpt_root: Where) -> None:
    """ "A missing item fails fast": the load raises before it restores the other items, so a template named
    before the missing item in into= is left as it was."""
    m = manager_factory()
    save(m, ckpt_root / "c", {"model": torch.full((3,), 5.0), "misc": {"step": 4}})
    target = torch.zeros(3)
    misc = {"step": 0}
    with pytest.raises(Exception):
        m.load(str(ckpt_root / "c"), into={"model": target, "misc": misc, "ghost": torch.zeros(1)})
    assert torch.equal(target, torch.zeros(3)), "the model template was filled before the missing item failed"
    assert misc == {"step": 0}, "the misc template was filled before the missing item failed"


@clause("REQUIRED-LOAD-2")
def test_optional_item_absent_from_checkpoint_loads(manager_factory: Factory, ckpt_root: Where) -> None:
    writer = manager_factory({"model": spec(), "extra": spec(required=False)})
    save(writer, ckpt_root / "c", {"model": torch.full((2,), 4.0)})
    reader = manager_factory({"model": spec(), "extra": spec(required=False)})
    target = torch.zeros(2)
    out = reader.load(str(ckpt_root / "c"), into={"model": target, "extra": None})
    assert torch.equal(out["model"], torch.full((2,), 4.0))


def _resharder(kind: str) -> Any:
    """A resharder the document names: the built-in `DTensorResharder`, or a custom `Resharder` subclass."""
    if kind == "dtensor":
        return backend.name("dtensor_resharder", "DTensorResharder")()
    from conformance.custom_resharder import DataloaderResharder

    return DataloaderResharder()


@clause("REQUIRED-SAVE-4")
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", ["dtensor", "custom"])
def test_optional_resharder_item_may_be_absent_on_save(
    manager_factory: Factory, ckpt_root: Where, kind: str, mode: str
) -> None:
    """ "set it False for optional items that may be absent" holds whatever else the spec declares: an optional
    item with a resharder (whose sharding metadata the manager records on save) may be left out of the payload."""
    m = manager_factory({"model": spec(), "extra": spec(required=False, resharder=_resharder(kind))}, mode=mode)
    save(m, ckpt_root / "c", {"model": torch.full((2,), 3.0)})
    out = m.load(str(ckpt_root / "c"), into={"model": torch.zeros(2)})
    assert torch.equal(out["model"], torch.full((2,), 3.0))


@clause("REQUIRED-LOAD-5")
@pytest.mark.parametrize("kind", ["dtensor", "custom"])
def test_optional_resharder_item_absent_from_checkpoint_loads(
    manager_factory: Factory, ckpt_root: Where, kind: str
) -> None:
    """The same on load: an optional item with a resharder, named in `into=` but absent from the checkpoint
    (written before the item existed), does not fail the load; the other items are restored."""
    writer = manager_factory({"model": spec()})
    save(writer, ckpt_root / "c", {"model": torch.full((2,), 4.0)})
    reader = manager_factory({"model": spec(), "extra": spec(required=False, resharder=_resharder(kind))})
    target = torch.zeros(2)
    reader.load(str(ckpt_root / "c"), into={"model": target, "extra": {"position": -1, "epoch": 0}})
    assert torch.equal(target, torch.full((2,), 4.0))


@clause("REQUIRED-LOAD-3")
def test_required_item_missing_from_into_fails_load(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"model": spec(), "optim": spec()})
    save(m, ckpt_root / "c", {"model": torch.ones(1), "optim": {"lr": 0.1}})
    with pytest.raises(Exception):
        m.load(str(ckpt_root / "c"), into={"model": torch.zeros(1)})


# ---------------------------------------------------------------- import locations
@clause("IMPORT-TOP-1")
def test_top_level_imports() -> None:
    top = backend.module()
    manager_cls = top.CheckpointManager
    assert isinstance(top.ItemSpec(), top.ItemSpec)
    assert isinstance(manager_cls.Config(), manager_cls.Config)


@clause("IMPORT-LAYOUT-1")
def test_layout_module_names() -> None:
    mod = backend.module("checkpoint_layout")
    for fmt in ("TorchSerialization", "JsonSerialization", "RawSerialization", "SafetensorsSerialization"):
        assert issubclass(getattr(mod, fmt), mod.SerializationFormat), fmt
    assert isinstance(mod.LayoutInfo("x.pt", mod.TorchSerialization()), mod.LayoutInfo)


@clause("IMPORT-RESHARD-1")
def test_resharder_import_locations() -> None:
    dt = backend.located("dtensor_resharder", "DTensorResharder")
    base = backend.located("resharding", "Resharder")
    assert issubclass(dt, base)


@clause("IMPORT-RESHARD-2")
def test_top_level_reexports() -> None:
    top, res = backend.module(), backend.module("resharding")
    for n in ("Resharder", "LoadPlan", "ReshardingInfo"):
        assert getattr(top, n) is getattr(res, n), n


@clause("IMPORT-EXAMPLE-1")
def test_full_example_imports() -> None:
    assert isinstance(backend.located("distributed_metadata", "DistributedItemMetadata"), type)
    assert isinstance(backend.located("distributed_metadata", "ShardingMetadata"), type)
    assert isinstance(backend.located("storage.base_storage", "Storage"), type)
    assert backend.located("types", "NestedPath") is not None
