"""What a load into templates returns as it was decoded (an entry the template lacks, a None in it) is a copy,
detached from the checkpoint's file. Making those copies must neither change the caller's templates when it
fails nor refuse what the safe loader returns.

Before: the copies were `copy.deepcopy` calls made while phase 2 filled the templates. A nested tensor (which
torch's `Tensor.__deepcopy__` cannot copy: `aten::new_empty` has no NestedTensor kernel) made a load into a
template raise, where a load without one returns it; and it raised after the template's tensors were already
overwritten, so a failed load changed the caller's model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig


class Uncopyable:
    """A trusted checkpoint's own object (weights_only=False) that refuses to be deep-copied."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Uncopyable:
        raise TypeError("Uncopyable cannot be deep-copied")


def _save(path: Path, model: dict[str, Any]) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(path), {"model": model})


def test_a_nested_tensor_the_template_lacks_loads_as_it_does_without_a_template(tmp_path: Path) -> None:
    nested = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
    _save(tmp_path / "s", {"w": torch.full((4,), 7.0), "extra": nested, "none": nested})
    template = {"model": {"w": torch.zeros(4), "none": None}}
    with CheckpointManager(CheckpointManager.Config()) as manager:
        loaded = manager.load(str(tmp_path / "s"), into=template)
    assert torch.equal(template["model"]["w"], torch.full((4,), 7.0))
    for key in ("extra", "none"):
        got = loaded["model"][key]
        assert got.is_nested and [t.tolist() for t in got.unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]
    assert loaded["model"]["extra"] is loaded["model"]["none"]  # saved as one tensor: returned as one


def test_an_object_that_cannot_be_deep_copied_loads_where_the_template_holds_none(tmp_path: Path) -> None:
    """Only tensors are copied (they were views of the file's mapping); an object is the decode's own. Copying
    every returned value whole made a trusted checkpoint's object that refuses deepcopy fail the load."""
    _save(tmp_path / "s", {"w": torch.full((4,), 7.0), "z": Uncopyable()})
    template = {"model": {"w": torch.zeros(4), "z": None}}
    with CheckpointManager(CheckpointManager.Config(load=CheckpointLoaderConfig(weights_only=False))) as manager:
        loaded = manager.load(str(tmp_path / "s"), into=template)
    assert torch.equal(template["model"]["w"], torch.full((4,), 7.0))
    assert isinstance(loaded["model"]["z"], Uncopyable)


def test_a_deeply_nested_entry_the_template_lacks_is_returned_whole(tmp_path: Path) -> None:
    """A safetensors name of many dots nests that deep; the copy of what a template load returns as decoded
    recursed and raised NestingError (tests/test_crafted_round14.py's strict case, 50,000 dots)."""
    from safetensors.torch import save_file

    from torch_checkpointing import ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization

    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig())
    config.items = {"model": ItemSpec(layout=LayoutInfo("m.safetensors", SafetensorsSerialization()))}
    deep = ".".join(["x"] * 5000)
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "s"), {"model": {"w": torch.full((4,), 7.0)}})
    file = tmp_path / "s" / "m.safetensors"
    save_file({"w": torch.full((4,), 7.0), deep: torch.ones(1)}, str(file))
    from tests.test_crafted_round9 import _forge

    _forge(tmp_path / "s", "m.safetensors")
    with CheckpointManager(config) as manager:
        loaded = manager.load(str(tmp_path / "s"), into={"model": {"w": torch.zeros(4)}})["model"]
    node = loaded
    for _ in range(5000):
        node = node["x"]
    assert torch.equal(node, torch.ones(1))
