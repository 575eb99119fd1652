"""What a save's copies of a value taken whole cost: only what the tree shares with it is the walk's.

A save takes a set, a deque or an object of the caller's whole; to keep what such a value shares with the tree
(a tensor under a key of its own too) the walks copy it with a memo that knows the tree. A tensor only the whole
value holds must not be copied by those walks that have no need to: the sync save's written form (the caller's
tensor is written from its own memory, as a plain torch.save does), and the handing of a staged item to the
writer process and its rebuilding there (the staging copy already made it private). Each copy of its data was
its size again in memory, and the time to copy it, on every save.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.staging import DefaultStager, as_written, from_slab_refs, to_slab_refs


class Holder:
    """An object of the caller's: a tensor the tree also holds, one only it holds, and a list."""

    def __init__(self, shared: torch.Tensor, own: torch.Tensor) -> None:
        self.shared, self.own, self.notes = shared, own, ["x"]


def _state() -> dict[str, Any]:
    weight = torch.full((4,), 5.0)
    return {"weight": weight, "slice": torch.arange(10.0)[2:5], "holder": Holder(weight, torch.full((6,), 7.0))}


def test_the_sync_written_form_keeps_a_tensor_only_a_whole_value_holds() -> None:
    state = _state()  # the slice needs its written form: the tree is rebuilt
    written = as_written(state)
    assert written["holder"].shared is written["weight"]  # what the rebuild is for
    assert written["holder"].own is state["holder"].own  # written from the caller's memory, not a copy of it


def test_handing_a_staged_item_over_copies_no_tensor_data_again() -> None:
    state = _state()
    stager = DefaultStager()
    try:
        staged = stager.stage({"model": state})["model"]
        slab = stager.slab
        assert slab is not None
        own = staged["holder"].own
        assert own is not state["holder"].own and own.data_ptr() != state["holder"].own.data_ptr()
        refs = to_slab_refs(staged, slab)
        assert refs["holder"].shared is refs["weight"]
        assert refs["holder"].own is own  # already the staging's copy: sent as it is
        rebuilt = from_slab_refs(refs, slab)
        assert rebuilt["holder"].shared is rebuilt["weight"]
        assert rebuilt["holder"].own is refs["holder"].own  # the writer's own, from the pipe
    finally:
        stager.close()


def test_sync_and_async_saves_of_a_whole_value_load_back_what_was_saved(tmp_path: Path) -> None:
    for name, save in (("sync", SyncCheckpointSaverConfig()), ("async", AsyncCheckpointSaverConfig())):
        state = _state()
        config = CheckpointManager.Config(save=save, load=CheckpointLoaderConfig(weights_only=False))
        with CheckpointManager(config) as manager:
            future = manager.save(str(tmp_path / name), {"model": state})
            if future is not None:
                state["holder"].own.fill_(-1.0)  # after save() returned: the staged copy is what is written
                future.result(timeout=120)
            loaded = manager.load(str(tmp_path / name))["model"]
        assert loaded["holder"].shared is loaded["weight"], name
        assert torch.equal(loaded["holder"].own, torch.full((6,), 7.0)), name
        assert torch.equal(loaded["slice"], torch.arange(2.0, 5.0)), name


class _Node:
    """An object of the caller's, taken whole."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


class NoDeepCopy:
    """Pickles (so torch.save writes it) but refuses a deep copy."""

    def __init__(self) -> None:
        self.v = 42

    def __deepcopy__(self, memo: dict[int, Any]) -> NoDeepCopy:
        raise TypeError("this object cannot be deep-copied")


def test_a_whole_value_whose_copy_failed_leaves_no_half_copy_to_another(tmp_path: Path) -> None:
    """The sync written form keeps a whole value whose deep copy fails as it is; the copy's memo, shared by the
    walk, kept what that copy had begun: an object it had made but not yet filled. Another whole value holding
    that object took the empty one, and the save wrote it silently with none of its attributes."""
    items = [1, 2]
    shared = _Node(items=items, x=NoDeepCopy())
    state = {"p": torch.nn.Parameter(torch.ones(2)), "items": items, "a": _Node(s=shared), "b": _Node(s=shared)}
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig(weights_only=False))
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "ck"), {"model": state})
        loaded = manager.load(str(tmp_path / "ck"))["model"]
    for name in ("a", "b"):
        assert vars(loaded[name].s).keys() == {"items", "x"}, (name, vars(loaded[name].s))
        assert loaded[name].s.items == [1, 2] and loaded[name].s.x.v == 42, name
