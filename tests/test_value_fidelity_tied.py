"""Template tensors that share memory (tied weights, overlapping views): a load fills each from its own saved
value, or refuses before its first copy naming both entries.

These tests failed before the fix: the copies were made one after the other, so a load of a checkpoint holding
different values for two tied template entries returned the first one holding the second one's values (the
last copy won), with no word said.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_value_fidelity import round_trip
from torch_checkpointing.checkpoint_layout import SafetensorsSerialization, SerializationFormat, TorchSerialization
from torch_checkpointing.errors import TemplateMismatchError

# ------------------------------------------------------------------------------------ tied template tensors

_TENSOR_FORMATS = [TorchSerialization(), SafetensorsSerialization()]


def _tied() -> dict[str, torch.Tensor]:
    w = torch.zeros(3)
    return {"a": w, "b": w}


def _overlapping() -> dict[str, torch.Tensor]:
    base = torch.zeros(4)
    return {"a": base[:3], "b": base[1:]}


def _transposed() -> dict[str, torch.Tensor]:
    base = torch.zeros(3, 3)
    return {"a": base, "b": base.t()}


def _inside() -> dict[str, torch.Tensor]:
    base = torch.zeros(10)
    return {"a": base, "b": base[1:2], "c": base[5:7]}  # two views inside a third, apart from each other


@pytest.mark.parametrize("fmt", _TENSOR_FORMATS, ids=lambda f: type(f).__name__)
@pytest.mark.parametrize("template", [_tied, _overlapping, _transposed, _inside], ids=lambda f: f.__name__.strip("_"))
def test_a_template_sharing_memory_is_refused_when_the_saved_values_differ(
    fmt: SerializationFormat, template: Any, tmp_path: Path
) -> None:
    saved = {k: torch.arange(float(v.numel())).reshape(v.shape) + i * 10 for i, (k, v) in enumerate(template().items())}
    into = template()
    before = {k: v.clone() for k, v in into.items()}
    with pytest.raises(TemplateMismatchError, match=r"cfg::a and cfg::b share memory"):
        round_trip(fmt, saved, tmp_path / "ck", into=into)
    assert all(torch.equal(into[k], before[k]) for k in into), "the refused load changed the template"


@pytest.mark.parametrize("fmt", _TENSOR_FORMATS, ids=lambda f: type(f).__name__)
def test_a_tied_template_takes_tied_saved_weights(fmt: SerializationFormat, tmp_path: Path) -> None:
    w = torch.randn(3, 2)
    saved = {"embed": w, "head": w, "other": torch.randn(2)}
    into = {"embed": torch.zeros(3, 2), "other": torch.zeros(2)}
    into["head"] = into["embed"]
    out = round_trip(fmt, saved, tmp_path / "ck", into=into)
    assert out["embed"] is into["embed"] and out["head"] is into["embed"]
    assert torch.equal(out["embed"], w) and torch.equal(out["other"], saved["other"])


@pytest.mark.parametrize("fmt", _TENSOR_FORMATS, ids=lambda f: type(f).__name__)
def test_overlapping_template_views_take_values_that_agree_where_they_overlap(
    fmt: SerializationFormat, tmp_path: Path
) -> None:
    source = torch.arange(4.0)
    into = _overlapping()
    out = round_trip(fmt, {"a": source[:3], "b": source[1:]}, tmp_path / "ck", into=into)
    assert torch.equal(out["a"], source[:3]) and torch.equal(out["b"], source[1:])


def test_a_tied_template_with_a_differing_nan_payload_is_refused(tmp_path: Path) -> None:
    """Compared bit for bit: two NaNs with different payloads are different saved values."""
    a = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    b = torch.tensor([0x7FC00002], dtype=torch.int32).view(torch.float32)
    w = torch.zeros(1)
    with pytest.raises(TemplateMismatchError, match="share memory"):
        round_trip(TorchSerialization(), {"a": a, "b": b}, tmp_path / "ck", into={"a": w, "b": w})


def test_views_inside_a_tied_tensor_take_values_that_agree_with_it(tmp_path: Path) -> None:
    saved = torch.arange(10.0)
    into = _inside()
    out = round_trip(TorchSerialization(), {"a": saved, "b": saved[1:2], "c": saved[5:7]}, tmp_path / "ck", into=into)
    assert torch.equal(out["a"], saved) and out["c"] is into["c"] and torch.equal(out["c"], saved[5:7])
