"""An empty list or tuple in an `into=` template follows the container rule like any other container.

Before, an empty list/tuple template returned the checkpoint's value as it was: a template list was not filled
in place (the caller's object kept nothing), a tuple template came back as the list JSON stores, and the
entries it lacked were neither warned about nor refused by `strict=True`. The rule (docs/guide.md): an empty
container has no entries, so every stored entry under it is one the template lacks (returned, warned about,
refused by strict), exactly as for an empty dict; an empty container that matches an empty stored one is a
full match.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    SafetensorsSerialization,
    SerializationFormat,
    TorchSerialization,
)
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import TemplateMismatchError

FORMATS: dict[str, SerializationFormat] = {
    "torch": TorchSerialization(),
    "json": JsonSerialization(),
    "safetensors": SafetensorsSerialization(),
}


def _manager(fmt: SerializationFormat) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items={"item": ItemSpec(layout=LayoutInfo("item.bin", fmt))}, save=SyncCheckpointSaverConfig()
        )
    )


def _leaf(fmt: str, i: int) -> Any:
    return float(i) if fmt == "json" else torch.full((2,), float(i))


def _same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a, b)) if isinstance(a, torch.Tensor) else bool(a == b)


@pytest.mark.parametrize("fmt", ["torch", "json"])
def test_an_empty_list_template_is_filled_in_place_and_an_empty_tuple_keeps_its_type(
    tmp_path: Path, fmt: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _manager(FORMATS[fmt]) as manager:
        manager.save(str(tmp_path / "c"), {"item": {"x": [_leaf(fmt, 1), _leaf(fmt, 2)], "y": (_leaf(fmt, 3),)}})
        mine: list[Any] = []
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            out = manager.load(str(tmp_path / "c"), into={"item": {"x": mine, "y": ()}})["item"]
    assert out["x"] is mine and len(mine) == 2 and _same(mine[1], _leaf(fmt, 2))
    assert type(out["y"]) is tuple and len(out["y"]) == 1 and _same(out["y"][0], _leaf(fmt, 3))
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "item::x.0" in warned and "item::x.1" in warned and "item::y.0" in warned, warned


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("empty", [list, tuple])
def test_strict_refuses_an_empty_template_for_a_stored_nonempty_container(
    tmp_path: Path, fmt: str, empty: type
) -> None:
    with _manager(FORMATS[fmt]) as manager:
        manager.save(str(tmp_path / "c"), {"item": {"x": [_leaf(fmt, 1), _leaf(fmt, 2)]}})
        mine = empty()
        with pytest.raises(TemplateMismatchError, match=r"not in the template \['item::x\.0', 'item::x\.1'\]"):
            manager.load(str(tmp_path / "c"), into={"item": {"x": mine}}, strict=True)
    assert len(mine) == 0  # refused before anything was copied


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_empty_templates_match_empty_stored_containers_under_strict(tmp_path: Path, fmt: str) -> None:
    """What the save walked as an empty container loads into the same empty container, strict or not."""
    value = {"e": [], "t": (), "f": {}, "n": {"a": []}, "w": _leaf(fmt, 1)}
    with _manager(FORMATS[fmt]) as manager:
        manager.save(str(tmp_path / "c"), {"item": value})
        template = {"e": [], "t": (), "f": {}, "n": {"a": []}, "w": _leaf(fmt, 0)}
        out = manager.load(str(tmp_path / "c"), into={"item": template}, strict=True)["item"]
    assert out["e"] == [] and out["t"] == () and type(out["t"]) is tuple and out["f"] == {} and out["n"] == {"a": []}
    assert _same(out["w"], _leaf(fmt, 1))
