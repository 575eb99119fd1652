"""Templates that `copy_()` cannot fill in place are refused in the check phase, before any item is copied.

Before, an expanded view or an inference tensor as template raised torch's bare RuntimeError from inside the
copy phase, after the items before it had been overwritten (not all-or-nothing); a meta template came back
unfilled with no error at all, so the load "succeeded" and restored nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, DTensorResharder, ItemSpec, TemplateMismatchError
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization, TorchSerialization
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

SAVED = torch.arange(6.0).reshape(2, 3)


def _expanded() -> torch.Tensor:
    return torch.zeros(1, 3).expand(2, 3)


def _inference() -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(2, 3)


BAD: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "meta": (lambda: torch.empty(2, 3, device="meta"), "meta device"),
    "expanded": (_expanded, "expanded view"),
    "inference": (_inference, "inference tensor"),
    "sparse": (lambda: torch.zeros(2, 3).to_sparse(), "Layout mismatch"),
}
FORMATS = {"torch": ("b.pt", TorchSerialization), "safetensors": ("b.safetensors", SafetensorsSerialization)}


@pytest.fixture
def manager() -> Iterator[CheckpointManager]:
    m = CheckpointManager(CheckpointManager.Config.with_sync_save())
    yield m
    m.close()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_template_that_cannot_be_filled_refuses_the_load_before_any_copy(
    tmp_path: Path, manager: CheckpointManager, bad: str, fmt: str
) -> None:
    path, serialization = FORMATS[fmt]
    manager.config.items = {"b": ItemSpec(layout=LayoutInfo(path, serialization()))}
    manager.save(str(tmp_path / "ck"), {"a": {"w": torch.ones(4)}, "b": {"x": SAVED}})
    make, says = BAD[bad]
    first = torch.zeros(4)
    with pytest.raises(TemplateMismatchError, match=rf"b::x.*{says}|{says}.*b::x"):
        manager.load(str(tmp_path / "ck"), into={"a": {"w": first}, "b": {"x": make()}})
    assert torch.equal(first, torch.zeros(4))  # the item before it was not touched


def test_a_template_made_in_inference_mode_loads_inside_it(tmp_path: Path, manager: CheckpointManager) -> None:
    """The refusal is about updating outside inference mode; inside it the same template is filled."""
    manager.save(str(tmp_path / "ck"), {"b": {"x": SAVED}})
    with torch.inference_mode():
        target = torch.zeros(2, 3)
        out = manager.load(str(tmp_path / "ck"), into={"b": {"x": target}})
    assert torch.equal(out["b"]["x"], SAVED) and out["b"]["x"] is target


@pytest.mark.parametrize("bad", ["meta", "expanded"])
def test_a_dtensor_template_that_cannot_be_filled_refuses_the_resharded_load(
    tmp_path: Path, mesh: Any, bad: str
) -> None:
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.items = {"model": ItemSpec(resharder=DTensorResharder())}
    m = CheckpointManager(config)
    try:
        m.save(str(tmp_path / "ck"), {"model": {"w": distribute_tensor(SAVED, mesh, [Replicate()])}})
        local, says = BAD[bad]
        target = DTensor.from_local(local(), mesh, [Replicate()], run_check=False)
        with pytest.raises(TemplateMismatchError, match=rf"model::w.*{says}|{says}.*model::w"):
            m.load(str(tmp_path / "ck"), into={"model": {"w": target}})
    finally:
        m.close()
