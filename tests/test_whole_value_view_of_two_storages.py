"""A tensor inside a value taken whole, viewing memory the tree holds as two storages, loads back the same from a
sync and an async save: the leaf itself as that leaf, any other view over the first such leaf's storage
(docs/guide.md).

The tree's `w` and `w.view(2, 3)` are written as two storages (the one-storage rule), so a view of `w` inside a
value the save takes whole (an object of the caller's) can only share one of them. Round 26 left the two modes
possibly disagreeing here, and the guide silent; they agree, and the guide now says which. A guard: it passes on
the code this branch started from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointLoaderConfig, SyncCheckpointSaverConfig


class Holder:
    """An object of the caller's, taken whole."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = list(tensors)


def _tree(first: str, inner: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    w = torch.arange(6.0)
    leaves = {"w": w, "v": w.view(2, 3)}
    order = [first, *(k for k in leaves if k != first)]
    return {**{k: leaves[k] for k in order}, "z": Holder(inner(w))}


INNERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "whole": lambda w: w,
    "reshaped": lambda w: w.view(2, 3),
    "other_shape": lambda w: w.view(3, 2),
    "slice": lambda w: w[1:4],
}


def _load_after(mode: str, root: Path, tree: dict[str, Any]) -> dict[str, Any]:
    save = SyncCheckpointSaverConfig() if mode == "sync" else AsyncCheckpointSaverConfig()
    config = CheckpointManager.Config(save=save, load=CheckpointLoaderConfig(weights_only=False))
    with CheckpointManager(config) as manager:
        future = manager.save(str(root / mode), {"m": tree})
        if future is not None:
            future.result(timeout=120)
        return dict(manager.load(str(root / mode))["m"])


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("first", ["w", "v"])
def test_the_view_shares_the_first_leaf_in_both_modes(tmp_path: Path, first: str, inner: str) -> None:
    seen = {}
    for mode in ("sync", "async"):
        loaded = _load_after(mode, tmp_path, _tree(first, INNERS[inner]))
        inside = loaded["z"].tensors[0]
        assert _storage(loaded["w"]) != _storage(loaded["v"]), "w and w.view(2, 3) are two storages"
        shared = "w" if inner == "whole" else first  # the leaf itself stays that leaf; any other view: the first
        assert _storage(inside) == _storage(loaded[shared]), f"{mode}: the view does not share {shared}'s storage"
        assert torch.equal(inside, INNERS[inner](torch.arange(6.0)))
        seen[mode] = (tuple(inside.shape), inside.storage_offset(), tuple(inside.stride()))
    assert seen["sync"] == seen["async"], seen
