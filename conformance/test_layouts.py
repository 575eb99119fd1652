"""Layouts, the {rank} placeholder, default and flat layouts (single process: rank 0)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
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
        li.file_path = "other.pt"  # type: ignore[misc]


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
@pytest.mark.parametrize("path", ["{step}/m_{rank}.pt", "m_{0}_{rank}.pt", "m_{}_{rank}.pt", "{rank_id}_{rank}.pt"])
def test_other_braces_stay_literal(manager_factory: Factory, ckpt_root: Where, path: str) -> None:
    m = manager_factory({"model": spec(layout=layout(path, "TorchSerialization"))})
    save(m, ckpt_root / "c", {"model": torch.ones(2)})
    assert path.replace("{rank}", "0") in files(ckpt_root / "c")
    assert torch.equal(m.load(str(ckpt_root / "c"), into={"model": torch.zeros(2)})["model"], torch.ones(2))


@clause("LAYOUT-DEFAULT-1", "KEY-CHARSET-1", "TORCH-FILE-1")
def test_default_layout_is_key_rank_pt(manager_factory: Factory, ckpt_root: Where) -> None:
    value = {"w": torch.arange(3.0), "n": 2}
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
