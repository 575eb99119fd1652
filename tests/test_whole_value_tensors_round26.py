"""A tensor of any kind a sync save writes inside a value taken whole (a deque, a set, an object of the caller's)
is written by an async save too, and loads back the same.

The async save deep-copies such a value and hands it to the writer process through a pipe. A deep copy refuses a
sparse CSR tensor, a nested tensor and a tensor autograd made (a row of an `nn.Parameter`), and the pipe's tensor
reduction loses a quantized tensor's quantizer: each failed the async save (the quantized one in the writer,
after `save()` had returned, saying the value does not pickle), where a sync save, and torch.save, wrote it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointLoaderConfig, SyncCheckpointSaverConfig


def _values(t: torch.Tensor) -> torch.Tensor:
    """What two tensors of one kind must agree on: their values, densified."""
    if t.is_nested:
        return torch.cat([x.flatten() for x in t.unbind()])
    if t.is_quantized:
        return torch.cat([t.dequantize().flatten(), torch.tensor([t.q_scale(), float(t.q_zero_point())])])
    return t.detach().to_dense()


KINDS: dict[str, Callable[[], torch.Tensor]] = {
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.tensor([0.5, -1.0, 2.0]), 0.5, 3, torch.qint8),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)]),
    "parameter_row": lambda: torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))[1],
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_tensor_inside_a_whole_value_is_saved_by_both_modes(tmp_path: Path, kind: str, mode: str) -> None:
    tensor = KINDS[kind]()
    save = SyncCheckpointSaverConfig() if mode == "sync" else AsyncCheckpointSaverConfig()
    config = CheckpointManager.Config(save=save, load=CheckpointLoaderConfig(weights_only=False))
    with CheckpointManager(config) as manager:
        future = manager.save(str(tmp_path / "ck"), {"model": {"w": torch.ones(2), "queue": deque([tensor, 7])}})
        if future is not None:
            future.result(timeout=120)
        loaded = manager.load(str(tmp_path / "ck"))["model"]["queue"]
    assert list(loaded)[1] == 7
    got = loaded[0]
    assert (got.layout, got.is_quantized, got.is_nested, got.dtype) == (
        tensor.layout,
        tensor.is_quantized,
        tensor.is_nested,
        tensor.dtype,
    )
    assert torch.equal(_values(got), _values(tensor))


class Holder:
    """An object of the caller's, taken whole."""

    def __init__(self, **attrs: object) -> None:
        self.__dict__.update(attrs)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_view_inside_a_whole_value_shares_the_trees_tensor_as_torch_save_keeps_it(tmp_path: Path, mode: str) -> None:
    """A view of a tree tensor held inside a value taken whole shared its memory after a sync save (both written
    from the caller's memory, as torch.save writes them) and not after an async save (the tree's tensor was
    staged into the slab, the view deep-copied with a copy of its own of the whole base)."""
    base = torch.arange(10.0)
    items = [1, 2]
    holder = Holder(view=base[2:5], alias=base.detach(), items=items)
    state = {"w": base, "tied": base.detach(), "items": items, "holder": holder}
    save = SyncCheckpointSaverConfig() if mode == "sync" else AsyncCheckpointSaverConfig()
    config = CheckpointManager.Config(save=save, load=CheckpointLoaderConfig(weights_only=False))
    with CheckpointManager(config) as manager:
        future = manager.save(str(tmp_path / "ck"), {"model": state})
        if future is not None:
            base.fill_(-1.0)  # after save() returned: what was staged is what is written
            future.result(timeout=120)
        loaded = manager.load(str(tmp_path / "ck"))["model"]
    w, holder = loaded["w"], loaded["holder"]
    assert torch.equal(w, torch.arange(10.0)) and torch.equal(holder.view, torch.arange(2.0, 5.0))
    assert _shares(holder.view, w) and _shares(holder.alias, w), "the view no longer shares the tree's tensor"
    assert holder.view.storage_offset() == 2 and holder.items is loaded["items"]
    assert loaded["tied"] is w  # one tensor, as docs/guide.md promises, in both modes
    w.add_(100.0)
    assert torch.equal(holder.view, torch.arange(102.0, 105.0))


@pytest.mark.parametrize("own_tensor", [False, True])
def test_a_list_shared_only_with_a_whole_value_loads_back_one_after_an_async_save(
    tmp_path: Path, own_tensor: bool
) -> None:
    """A value taken whole holding a list of the tree but no tensor of the slab was sent to the writer as it was,
    holding the staged list, while the hand-over (and the writer) rebuilt the tree's: two lists in the file."""
    items = [1, [2, 3]]
    holder = Holder(items=items, own=torch.ones(3)) if own_tensor else Holder(items=items)
    state = {"w": torch.ones(2), "items": items, "holder": holder, "later": deque([items])}
    load = CheckpointLoaderConfig(weights_only=False)
    with CheckpointManager(CheckpointManager.Config(save=AsyncCheckpointSaverConfig(), load=load)) as manager:
        future = manager.save(str(tmp_path / "ck"), {"model": state})
        assert future is not None
        future.result(timeout=120)
        loaded = manager.load(str(tmp_path / "ck"))["model"]
    assert loaded["holder"].items is loaded["items"] and loaded["later"][0] is loaded["items"]
    assert loaded["items"] == [1, [2, 3]]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_leaves_viewing_one_memory_follow_the_one_storage_rule_in_both_modes(tmp_path: Path, mode: str) -> None:
    """docs/guide.md: leaves that are the same view of the same memory (`w`, `w.detach()`, `w[:]`) load back as
    one tensor, every other tensor (`w.view(2, 3)`) as a storage of its own. A sync save of a tree with nothing
    to rebuild (no parameter, no slice) handed the caller's tree to torch.save as it was: each such leaf loaded
    back as a tensor of its own viewing the one storage (the async save, staging each alias once, kept the rule)."""
    w = torch.arange(6.0)
    state = {"w": w, "detached": w.detach(), "full_slice": w[:], "reshaped": w.view(2, 3)}
    save = SyncCheckpointSaverConfig() if mode == "sync" else AsyncCheckpointSaverConfig()
    with CheckpointManager(CheckpointManager.Config(save=save)) as manager:
        future = manager.save(str(tmp_path / "ck"), {"model": state})
        if future is not None:
            future.result(timeout=120)
        loaded = manager.load(str(tmp_path / "ck"))["model"]
    assert loaded["detached"] is loaded["w"] and loaded["full_slice"] is loaded["w"]
    assert not _shares(loaded["reshaped"], loaded["w"]), "a view of another shape is written as a storage of its own"
    assert torch.equal(loaded["reshaped"], torch.arange(6.0).view(2, 3)) and torch.equal(loaded["w"], w)


def test_a_view_inside_a_whole_value_shares_the_trees_tensor_with_requires_copy_false(tmp_path: Path) -> None:
    """The same promise for an item the async save sends uncopied (`requires_copy=False`): its tensors' bytes
    travel out of band, one buffer per storage, but the writer made a storage of its own over that buffer at
    each tensor that named it, and torch.save, which tells storages apart by their C++ object, wrote the
    view's bytes a second time: the view loaded back independent of the tree's tensor."""
    base = torch.arange(10.0)
    state = {"w": base, "holder": Holder(view=base[2:5], alias=base.detach())}
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(),
        load=CheckpointLoaderConfig(weights_only=False),
        items={"model": ItemSpec(requires_copy=False)},
    )
    with CheckpointManager(config) as manager:
        future = manager.save(str(tmp_path / "ck"), {"model": state})
        assert future is not None
        future.result(timeout=120)
        loaded = manager.load(str(tmp_path / "ck"))["model"]
    w, holder = loaded["w"], loaded["holder"]
    assert torch.equal(w, base) and torch.equal(holder.view, torch.arange(2.0, 5.0))
    assert _shares(holder.view, w) and _shares(holder.alias, w), "the view no longer shares the tree's tensor"
    assert holder.view.storage_offset() == 2
