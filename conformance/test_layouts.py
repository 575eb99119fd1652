"""Layouts, the {rank} placeholder, default and flat layouts (single process: rank 0)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conformance import backend
from conformance.helpers import Where, files, layout, read_text, save, spec, torch_load

clause = pytest.mark.clause
Factory = Callable[..., Any]


@clause("LAYOUT-INFO-1")
def test_layoutinfo_is_a_frozen_dataclass() -> None:
    layout_info = backend.name("checkpoint_layout", "LayoutInfo")
    assert [f.name for f in dataclasses.fields(layout_info)] == ["file_path", "serialization_format"]
    li = layout("model.pt", "TorchSerialization")
    assert li.file_path == "model.pt"
    assert isinstance(li.serialization_format, backend.name("checkpoint_layout", "TorchSerialization"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        li.file_path = "other.pt"


@clause("LAYOUT-PATH-1")
def test_file_path_is_relative_to_checkpoint_dir(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"model": spec(layout=layout("model.pt", "TorchSerialization"))})
    save(m, ckpt_root / "c", {"model": {"w": torch.ones(3)}})
    assert "model.pt" in files(ckpt_root / "c")
    assert torch.equal(torch_load(ckpt_root / "c" / "model.pt")["w"], torch.ones(3))
    out = m.load(str(ckpt_root / "c"), into={"model": {"w": torch.zeros(3)}})
    assert torch.equal(out["model"]["w"], torch.ones(3))


@clause("LAYOUT-SUBDIR-1", "LAYOUT-RANK-1", "LAYOUT-RANK-2")
def test_per_rank_subdirectory(manager_factory: Factory, ckpt_root: Where) -> None:
    items = {
        "model": spec(layout=layout("rank_{rank}/model.pt", "TorchSerialization")),
        "meta": spec(layout=layout("a/b/c.json", "JsonSerialization")),
    }
    m = manager_factory(items)
    save(m, ckpt_root / "c", {"model": torch.arange(4.0), "meta": {"k": [1, 2]}})
    assert {"rank_0/model.pt", "a/b/c.json"} <= files(ckpt_root / "c")
    out = m.load(str(ckpt_root / "c"), into={"model": torch.zeros(4), "meta": None})
    assert torch.equal(out["model"], torch.arange(4.0))
    assert out["meta"] == {"k": [1, 2]}


@clause("LAYOUT-UNIQUE-1")
def test_each_key_gets_its_own_file(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory()
    payload = {"model": torch.ones(1), "optimizer": torch.zeros(1), "step": 3, "model_state": 4}
    save(m, ckpt_root / "c", payload)
    assert {f"{k}_0.pt" for k in payload} <= files(ckpt_root / "c")
    for k, v in payload.items():
        got = torch_load(ckpt_root / "c" / f"{k}_0.pt")
        assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, k


@clause("LAYOUT-RANK-1", "LAYOUT-RANK-2", "LAYOUT-RANK-3")
def test_every_rank_placeholder_is_substituted(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"model": spec(layout=layout("r{rank}/part_{rank}/model_{rank}.pt", "TorchSerialization"))})
    save(m, ckpt_root / "c", {"model": torch.full((2,), 5.0)})
    assert "r0/part_0/model_0.pt" in files(ckpt_root / "c")
    assert not any("{" in f for f in files(ckpt_root / "c"))
    out = m.load(str(ckpt_root / "c"), into={"model": torch.zeros(2)})
    assert torch.equal(out["model"], torch.full((2,), 5.0))


@clause("LAYOUT-BRACES-1")
def test_key_placeholder_stays_literal(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"blob": spec(layout=layout("raw_{key}_{rank}.bin", "RawSerialization"))})
    save(m, ckpt_root / "c", {"blob": b"xyz"})
    assert "raw_{key}_0.bin" in files(ckpt_root / "c")
    assert "raw_blob_0.bin" not in files(ckpt_root / "c")
    assert m.load(str(ckpt_root / "c"), into={"blob": None})["blob"] == b"xyz"


@clause("LAYOUT-BRACES-2")
@pytest.mark.parametrize(
    "path",
    [
        "{step}/m_{rank}.pt",
        "m_{0}_{rank}.pt",
        "m_{}_{rank}.pt",
        "{rank_id}_{rank}.pt",
        "m_{rank:03d}_{rank}.pt",
        "m_{RANK}_{ rank }_{rank}.pt",
    ],
)
def test_other_braces_stay_literal(manager_factory: Factory, ckpt_root: Where, path: str) -> None:
    m = manager_factory({"model": spec(layout=layout(path, "TorchSerialization"))})
    save(m, ckpt_root / "c", {"model": torch.ones(2)})
    assert path.replace("{rank}", "0") in files(ckpt_root / "c")
    assert torch.equal(m.load(str(ckpt_root / "c"), into={"model": torch.zeros(2)})["model"], torch.ones(2))


@clause("LAYOUT-DEFAULT-1", "KEY-CHARSET-1", "TORCH-FILE-1")
def test_default_layout_is_key_rank_pt(manager_factory: Factory, ckpt_root: Where) -> None:
    value: dict[str, Any] = {"w": torch.arange(3.0), "n": 2}
    m = manager_factory({"model_state": spec(layout=None)})
    save(m, ckpt_root / "c", {"model_state": value})
    assert "model_state_0.pt" in files(ckpt_root / "c")
    got = torch_load(ckpt_root / "c" / "model_state_0.pt")
    assert torch.equal(got["w"], value["w"]) and got["n"] == 2


@clause("LAYOUT-FLAT-1", "TORCH-FILE-1")
def test_canonical_flat_layout(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"model_state": spec(layout=layout("model_state_{rank}.pt", "TorchSerialization"))})
    value = {"layer": {"w": torch.randn(2, 2, generator=torch.Generator().manual_seed(1))}}
    save(m, ckpt_root / "c", {"model_state": value})
    got = torch_load(ckpt_root / "c" / "model_state_0.pt")
    assert torch.equal(got["layer"]["w"], value["layer"]["w"])
    out = m.load(str(ckpt_root / "c"), into={"model_state": {"layer": {"w": torch.zeros(2, 2)}}})
    assert torch.equal(out["model_state"]["layer"]["w"], value["layer"]["w"])


@clause("JSON-ROUNDTRIP-1", "LAYOUT-RANK-1")
def test_json_per_rank_file(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory(
        {"misc_state": spec(requires_copy=False, layout=layout("misc_state_{rank}.json", "JsonSerialization"))}
    )
    save(m, ckpt_root / "c", {"misc_state": {"step": 11, "cfg": {"lr": 0.5, "names": ["a", "b"]}}})
    data = json.loads(read_text(ckpt_root / "c" / "misc_state_0.json"))
    assert data == {"step": 11, "cfg": {"lr": 0.5, "names": ["a", "b"]}}


# Pairs of items whose layouts resolve to the same file on rank 0: identical paths, a custom path equal to
# another key's default file, and a {rank} path that expands to another item's fixed path.
SHARED_FILES = {
    "same-path": ({"a": ("same.pt", "TorchSerialization"), "b": ("same.pt", "TorchSerialization")}, ("a", "b")),
    "a-default-file": ({"x": ("model_0.pt", "TorchSerialization")}, ("model", "x")),
    "dot-segment": ({"a": ("./m.pt", "TorchSerialization"), "b": ("m.pt", "TorchSerialization")}, ("a", "b")),
    "double-slash": ({"a": ("d//m.pt", "TorchSerialization"), "b": ("d/m.pt", "TorchSerialization")}, ("a", "b")),
    "rank-expands-onto-fixed": (
        {"x": ("m_{rank}.json", "JsonSerialization"), "y": ("m_0.json", "JsonSerialization")},
        ("x", "y"),
    ),
}


def _each_key_keeps_its_value(m: Any, where: Where, k1: str, k2: str) -> None:
    """Save two keys laid out onto one file: the save raises, or each key loads back its own value."""
    payload = {k1: {"who": 1}, k2: {"who": 2}}
    try:
        save(m, where, payload)
    except Exception:
        return  # refused: no file is shared
    out = m.load(str(where), into={k1: None, k2: None})
    assert (out[k1], out[k2]) == (payload[k1], payload[k2]), "one key's file was overwritten by the other's"


@clause("LAYOUT-UNIQUE-2")
@pytest.mark.parametrize("case", sorted(SHARED_FILES))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_keys_never_share_a_file(manager_factory: Factory, ckpt_root: Where, case: str, mode: str) -> None:
    """The document: "each key maps to its own unique file — there is no file sharing between keys". Two keys
    laid out onto one file must not silently share it: the save raises, or each key loads back its own value."""
    layouts, (k1, k2) = SHARED_FILES[case]
    m = manager_factory({k: spec(layout=layout(path, fmt)) for k, (path, fmt) in layouts.items()}, mode=mode)
    _each_key_keeps_its_value(m, ckpt_root / "c", k1, k2)


# A default layout with a fixed path, reached by two un-listed keys, or by one un-listed key and a listed one.
DEFAULT_SHARED = {
    "two-unlisted": ({}, ("a", "b")),
    "unlisted-onto-listed": ({"a": ("shared_{rank}.json", "JsonSerialization")}, ("a", "b")),
}


@clause("LAYOUT-UNIQUE-4")
@pytest.mark.parametrize("case", sorted(DEFAULT_SHARED))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_default_layout_never_shares_a_file(manager_factory: Factory, ckpt_root: Where, case: str, mode: str) -> None:
    """ "Keys not listed in items fall back to Config.default" and "each key maps to its own unique file": a
    default whose layout has a fixed path would put every un-listed key on one file. The save raises, or each
    key loads back its own value."""
    listed, (k1, k2) = DEFAULT_SHARED[case]
    default = spec(layout=layout("shared_0.json", "JsonSerialization"))
    m = manager_factory({k: spec(layout=layout(path, fmt)) for k, (path, fmt) in listed.items()}, default, mode=mode)
    _each_key_keeps_its_value(m, ckpt_root / "c", k1, k2)


ESCAPING_PATHS = ["../escape_up.pt", "sub/../../escape_up2.pt", "sub/../../../escape_up3.pt"]


def _escaped(root: Where, inside: str) -> set[str]:
    """Files under ``root`` named like the escape targets that do not lie under ``inside``."""
    return {p for p in files(root) if p.rsplit("/", 1)[-1].startswith("escape") and not p.startswith(inside + "/")}


@clause("LAYOUT-PATH-2")
@pytest.mark.parametrize("path", ESCAPING_PATHS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_file_path_does_not_climb_out_of_the_checkpoint(
    manager_factory: Factory, ckpt_root: Where, path: str, mode: str
) -> None:
    """The document: "file_path is relative to the checkpoint directory". A path that climbs out with ".." is
    not a file of the checkpoint: the save raises or keeps the file inside, and never writes beside it."""
    m = manager_factory({"x": spec(layout=layout(path, "TorchSerialization"))}, mode=mode)
    checkpoint = ckpt_root / "ids" / "c"
    with contextlib.suppress(Exception):  # refusing the path is one way to hold the clause
        save(m, checkpoint, {"x": torch.ones(2)})
    assert not _escaped(ckpt_root, "ids/c"), f"{path!r} wrote outside the checkpoint directory"


@clause("LAYOUT-PATH-2")
@pytest.mark.local_only("an absolute local path is outside an object store's prefix by construction")
def test_absolute_file_path_is_not_written_outside(manager_factory: Factory, ckpt_root: Where) -> None:
    outside = Path(str(ckpt_root)) / "elsewhere" / "escape_abs.pt"
    m = manager_factory({"x": spec(layout=layout(str(outside), "TorchSerialization"))})
    with contextlib.suppress(Exception):  # refusing the path is one way to hold the clause
        save(m, ckpt_root / "ids" / "c", {"x": torch.ones(2)})
    assert not outside.exists(), "an absolute file_path was written outside the checkpoint directory"


@clause("LAYOUT-DEFAULT-3")
@pytest.mark.parametrize(("key", "rank"), [("model_state", 3), ("model", 0), ("a-b_c", 12)])
def test_default_layout_info_is_key_rank_torch(key: str, rank: int) -> None:
    """The document gives the default layout as ``default_layout_info(key, rank)`` returning
    ``LayoutInfo(f"{key}_{rank}.pt", TorchSerialization())``."""
    fn = backend.name("checkpoint_layout", "default_layout_info")
    info = fn(key, rank)
    assert isinstance(info, backend.name("checkpoint_layout", "LayoutInfo"))
    assert info.file_path == f"{key}_{rank}.pt"
    assert isinstance(info.serialization_format, backend.name("checkpoint_layout", "TorchSerialization"))


def _bookkeeping_files(manager_factory: Factory, root: Where) -> list[str]:
    """The files a backend writes into a checkpoint besides its item files (a save with a resharder declared,
    so that whatever sharding metadata it records is among them)."""
    resharder = backend.name("dtensor_resharder", "DTensorResharder")()
    m = manager_factory({"model": spec(resharder=resharder)})
    save(m, root, {"model": {"w": torch.ones(2)}})
    return sorted(files(root) - {"model_0.pt"})


@clause("LAYOUT-PATH-3")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_layout_on_a_bookkeeping_file_name_keeps_the_checkpoint_whole(
    manager_factory: Factory, ckpt_root: Where, mode: str
) -> None:
    """The document: file_path "gives you full control over naming". An item laid out onto the name of a file
    the backend itself writes into a checkpoint must not damage it: the save raises, or every item (the
    resharded one included) loads back as saved."""
    names = _bookkeeping_files(manager_factory, ckpt_root / "probe")
    # A backend that writes only item files holds the clause by construction (the loop is empty).
    resharder = backend.name("dtensor_resharder", "DTensorResharder")()
    for i, name in enumerate(names):
        items = {"model": spec(resharder=resharder), "x": spec(layout=layout(name, "RawSerialization"))}
        m = manager_factory(items, mode=mode)
        where = ckpt_root / f"c{i}"
        try:
            save(m, where, {"model": {"w": torch.full((2,), 3.0)}, "x": b"user bytes"})
        except Exception:
            continue  # refused: nothing shares the name
        out = m.load(str(where), into={"model": {"w": torch.zeros(2)}, "x": None})
        assert out["x"] == b"user bytes", f"item laid out on {name!r} did not load back"
        assert torch.equal(out["model"]["w"], torch.full((2,), 3.0)), f"{name!r}: the resharded item did not load"
