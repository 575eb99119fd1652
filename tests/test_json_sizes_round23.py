"""A JSON item's number handed to a field's declared type as a size (round 23).

`JsonSerialization(cls=...)` rebuilds a field whose JSON value is not of its annotated type by calling the
type on it (an IntEnum from its int, a str subclass from its str), then refuses the result unless it writes
the same JSON. A crafted file's number reached any annotated type that way: `bytearray(2**31)` zero-filled
2 GiB before the rebuild was refused (more where memory allowed) for a field `data: bytearray | None` saved
as None; `bytes(n)` and `torch.Tensor(n)` read it as a size too. A load never
allocates what the file does not hold: a JSON number is now converted only to a numeric type or an Enum, and
any other annotation refuses it naming the field, before anything is copied.
"""

from __future__ import annotations

import dataclasses
import json
import resource
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_crafted_round9 import _forge, in_child
from tests.test_value_fidelity_json_load import _manager
from torch_checkpointing.errors import CheckpointError


@dataclasses.dataclass
class Blob:
    data: bytearray | None = None
    count: int = 0


class Level(int):
    """An int subclass: still rebuilt from its JSON number."""


@dataclasses.dataclass
class Counted:
    level: Level
    ratio: float


def _craft(root: Path, value: dict[str, Any]) -> None:
    (root / "hparams.json").write_bytes(json.dumps(value).encode())
    _forge(root, "hparams.json", "hparams")


def json_outcome(root: str) -> dict[str, Any]:
    """(child side) Load the Blob item beside a model: what was raised, and whether the model changed."""
    into: dict[str, Any] = {"hparams": None, "model": {"w": torch.zeros(3)}}
    try:
        with _manager(Blob) as m:
            m.load(root, into=into)
        outcome: dict[str, Any] = {"raised": None}
    except CheckpointError as exc:
        outcome = {"raised": type(exc).__name__, "message": str(exc)}
    except MemoryError as exc:
        outcome = {"raised": "MemoryError", "message": str(exc)}
    outcome["unchanged"] = not bool(into["model"]["w"].any())
    outcome["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return outcome


@pytest.mark.parametrize("size", [2**31, 2**62])
def test_a_json_number_is_not_read_as_a_size_by_a_fields_declared_type(tmp_path: Path, size: int) -> None:
    """Defect: bytearray(n) ran on the crafted number: 2 GiB zero-filled (the child's peak RSS over 2 GiB)
    before the rebuild was refused; larger numbers failed only where memory ran out."""
    root = tmp_path / "ck"
    with _manager(Blob) as m:
        m.save(str(root), {"hparams": Blob(), "model": {"w": torch.ones(3)}})
    _craft(root, {"data": size, "count": 0})
    outcome = in_child(f"json_outcome({str(root)!r})", __name__)
    assert outcome["raised"] == "TemplateMismatchError", outcome
    assert "hparams.json" in outcome["message"] and "data" in outcome["message"], outcome
    assert outcome["unchanged"], outcome
    assert outcome["peak_mib"] < 1024, outcome  # the load holds a 3-element model and a tiny JSON file


def test_numbers_still_rebuild_numeric_subclasses(tmp_path: Path) -> None:
    """Held before and after: an int subclass and an int under a float annotation load back as saved."""
    with _manager(Counted) as m:
        m.save(str(tmp_path / "ck"), {"hparams": Counted(Level(3), 2)})
        loaded = m.load(str(tmp_path / "ck"), into={"hparams": None})["hparams"]
    assert loaded == Counted(Level(3), 2) and type(loaded.level) is Level and type(loaded.ratio) is int
