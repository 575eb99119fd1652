"""The async hand-over of a staged item costs in proportion to the item, however many values it takes whole.

After save() returns, the comm thread turns the staged tree into what travels to the writer (to_slab_refs) and
the writer turns it back (from_slab_refs). Each value taken whole is looked through for a container of the
item's tree, and the ids it holds were matched against the tree's nodes by `set.intersection(nodes)`, which
walks every node of the tree: once per value taken whole. An item holding one small object per layer (a
model's per-layer metadata) paid nodes x values: 8,000 layers took 9 s to hand over where 2,000 took 1 s.

Counted, not timed (no timed unit tests): how many times the tree's node mapping is walked whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from torch_checkpointing import traversal
from torch_checkpointing.staging import from_slab_refs, to_slab_refs

LAYERS = 200


class Meta:
    """A value taken whole (neither a tensor nor a container the walk enters), one per layer."""

    def __init__(self, i: int) -> None:
        self.i = i


class _CountedWalks(dict[int, Any]):
    """The tree's node mapping, counting each walk of it whole (membership tests are not walks)."""

    walks = 0

    def __iter__(self) -> Iterator[int]:
        _CountedWalks.walks += 1
        return super().__iter__()

    def items(self) -> Any:
        _CountedWalks.walks += 1
        return super().items()

    def keys(self) -> Any:
        _CountedWalks.walks += 1
        return super().keys()

    def values(self) -> Any:
        _CountedWalks.walks += 1
        return super().values()


def test_values_taken_whole_do_not_each_walk_the_whole_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """One walk of the node mapping per memo (the set of container ids is made once), not one per value
    taken whole: on the old code the count grew with LAYERS."""
    real = traversal.TreeMemo._tree_nodes

    def counted(memo: traversal.TreeMemo) -> dict[int, Any]:
        nodes = real(memo)
        if not isinstance(nodes, _CountedWalks):
            nodes = _CountedWalks(nodes)
            memo._nodes = nodes
        return nodes

    monkeypatch.setattr(traversal.TreeMemo, "_tree_nodes", counted)
    monkeypatch.setattr(_CountedWalks, "walks", 0)
    slab = torch.zeros(2 * LAYERS)
    tree = {"layers": [{"w": slab[2 * i : 2 * i + 2], "meta": Meta(i)} for i in range(LAYERS)]}
    back = from_slab_refs(to_slab_refs(tree, slab), slab)
    assert _CountedWalks.walks <= 4, _CountedWalks.walks  # a few per memo, never one per layer
    assert [m["meta"].i for m in back["layers"]] == list(range(LAYERS))
    assert torch.equal(back["layers"][-1]["w"], slab[-2:])
