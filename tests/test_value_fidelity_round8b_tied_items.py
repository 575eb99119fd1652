"""Template tensors shared between items (`into={"model": sd, "ema": sd_with_the_same_tensors}`): a load fills
each from its own saved value, or refuses before its first copy naming both entries.

The refusals failed before the fix: the loader dry-ran and checked each item on its own, so the later item's
copy overwrote the earlier one's values in the shared tensor, with no word said.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_value_fidelity_round8b_tied_reshard import _manager, _replicated, _sharded
from torch_checkpointing import ItemSpec
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import TemplateMismatchError


def test_items_whose_templates_share_a_tensor_are_refused_when_the_saved_values_differ(tmp_path: Path) -> None:
    with _manager({"model": ItemSpec(), "ema": ItemSpec()}) as manager:
        manager.save(str(tmp_path / "ck"), {"model": {"w": torch.ones(3)}, "ema": {"w": torch.full((3,), 2.0)}})
        w = torch.zeros(3)
        other = torch.zeros(2)
        into = {"model": {"w": w, "o": other}, "ema": {"w": w}}
        with pytest.raises(TemplateMismatchError, match=r"model::w and ema::w share memory"):
            manager.load(str(tmp_path / "ck"), into=into)
        assert torch.equal(w, torch.zeros(3)), "the refused load changed the template"


def test_items_sharing_a_tensor_load_when_the_saved_values_agree(tmp_path: Path) -> None:
    with _manager({"model": ItemSpec(), "ema": ItemSpec()}) as manager:
        manager.save(str(tmp_path / "ck"), {"model": {"w": torch.ones(3)}, "ema": {"w": torch.ones(3)}})
        w = torch.zeros(3)
        restored = manager.load(str(tmp_path / "ck"), into={"model": {"w": w}, "ema": {"w": w}})
        assert restored["model"]["w"] is w and torch.equal(w, torch.ones(3))


def test_a_direct_item_and_a_resharded_item_sharing_a_tensor_are_refused(mesh: Any, tmp_path: Path) -> None:
    """The neighbour: one item read directly, the other resharded, their templates tied."""
    items = {"model": ItemSpec(), "opt": ItemSpec(resharder=DTensorResharder())}
    with _manager(items) as manager:
        saved = {"model": {"w": _replicated(mesh, torch.ones(4))}, "opt": {"w": _sharded(mesh, torch.arange(4.0))}}
        manager.save(str(tmp_path / "ck"), saved)
        w = _replicated(mesh, torch.zeros(4))
        with pytest.raises(TemplateMismatchError, match=r"(model::w and opt::w|opt::w and model::w) share memory"):
            manager.load(str(tmp_path / "ck"), into={"model": {"w": w}, "opt": {"w": w}})
        assert torch.equal(w.to_local(), torch.zeros(4)), "the refused load changed the template"


def test_two_resharded_items_sharing_a_tensor_are_refused(mesh: Any, tmp_path: Path) -> None:
    items = {"opt": ItemSpec(resharder=DTensorResharder()), "ema": ItemSpec(resharder=DTensorResharder())}
    with _manager(items) as manager:
        saved = {"opt": {"w": _sharded(mesh, torch.arange(4.0))}, "ema": {"w": _sharded(mesh, torch.arange(4.0) + 1)}}
        manager.save(str(tmp_path / "ck"), saved)
        w = _replicated(mesh, torch.zeros(4))
        with pytest.raises(TemplateMismatchError, match=r"(ema::w and opt::w|opt::w and ema::w) share memory"):
            manager.load(str(tmp_path / "ck"), into={"opt": {"w": w}, "ema": {"w": w}})
        assert torch.equal(w.to_local(), torch.zeros(4)), "the refused load changed the template"
        restored = manager.load(
            str(tmp_path / "ck"), into={"opt": {"w": w}, "ema": {"w": _replicated(mesh, torch.zeros(4))}}
        )
        assert torch.equal(restored["opt"]["w"].to_local(), torch.arange(4.0))
