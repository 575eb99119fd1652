"""A resharding load into template tensors that require grad (round 23).

`model.state_dict(keep_vars=True)`, `dict(model.named_parameters())` and an optimizer's parameters hold
`nn.Parameter`s: leaves that require grad. A direct load fills them (its copies run under `torch.no_grad()`);
a DTensorResharder load copied its blocks with autograd on, so the first such target raised torch's bare
`RuntimeError: a view of a leaf Variable that requires grad is being used in an in-place operation` in the
copy phase, after the entries before it were already overwritten: a half-restored template and no
CheckpointError. The promise (docs/durability.md): load() returns exactly what was committed, or raises
having changed nothing.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_verified_loads import AlwaysReshard, _manager
from torch_checkpointing import ItemSpec

N = 4096
SAVED = {"v": torch.arange(N, dtype=torch.float32) + 1, "w": torch.arange(N, dtype=torch.float32)}


def _saved(root: Path) -> Path:
    m = _manager({"model": ItemSpec(resharder=AlwaysReshard())})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            m.save(str(root), {"model": SAVED})
    finally:
        m.close()
    return root


def _load(root: Path, template: dict[str, torch.Tensor], resharded: bool) -> Any:
    m = _manager({"model": ItemSpec(resharder=AlwaysReshard() if resharded else None)})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            return m.load(str(root), into={"model": template})
    finally:
        m.close()


def _grad_leaf() -> torch.Tensor:
    return torch.nn.Parameter(torch.zeros(N))


@pytest.mark.parametrize("resharded", [True, False], ids=["resharded", "direct"])
@pytest.mark.parametrize("make", [_grad_leaf, lambda: torch.zeros(N, requires_grad=True)], ids=["param", "leaf"])
def test_a_load_fills_template_tensors_that_require_grad(tmp_path: Path, resharded: bool, make: Any) -> None:
    """Defect (resharded): a bare RuntimeError from the copy phase, with 'v' already overwritten. The direct
    load held."""
    root = _saved(tmp_path / "ck")
    template = {"v": torch.zeros(N), "w": make()}
    w = template["w"]
    _load(root, template, resharded)
    assert template["w"] is w and w.requires_grad and w.grad_fn is None  # still the caller's leaf
    for key, value in SAVED.items():
        assert torch.equal(template[key].detach(), value), key
