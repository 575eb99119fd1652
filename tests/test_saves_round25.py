"""Saves (round 25): values made at each access, and what an opaque leaf shares with the tree around it.

* `walk_sizes` (the shared-subtree bound every Torch save and load applies) told containers apart by their id
  while letting go of the ones it had counted: a Mapping that makes its values at each access (a lazy view of
  a table) gave a freed container's id to the next one made, which was taken for the first one met again. The
  count then said "shared" where nothing was, and a save of such a state, sharing nothing, was refused as one a
  load would take for a crafted file.
* The JSON encoder's check of a tree (what JSON cannot hold, cycles) marked the containers on the current path
  by id and dropped each one while still under it: a container made at the access below a dropped one took its
  id and was refused as "contains itself", a cycle where there was none.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.traversal import walk_sizes


class _Table(Mapping[int, Any]):
    """A read-only view whose values are made at each access: `depth` levels of such views, then a fresh list
    of `width` ints. Nothing but the walk holds a value once it is made, so the next one made may take its id."""

    def __init__(self, rows: int, depth: int, width: int) -> None:
        self.rows, self.depth, self.width = rows, depth, width

    def __getitem__(self, key: int) -> Any:
        if self.depth == 0:
            return list(range(self.width))
        return _Table(1, self.depth - 1, self.width)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rows))

    def __len__(self) -> int:
        return self.rows


def _positions(rows: int, width: int) -> int:
    """The positions a walk of `_Table(rows, 1, width)` visits: each of its views, lists and ints, once."""
    return 1 + rows * (1 + 1 + width)


def test_counting_values_made_at_each_access_counts_each_one_made() -> None:
    table = _Table(300, 1, 500)
    assert walk_sizes(table) == (_positions(300, 500), _positions(300, 500))  # nothing is shared


def test_a_state_of_values_made_at_each_access_sharing_nothing_is_saved(tmp_path: Path) -> None:
    """With the counted lists dropped, the later ones were taken for them: 2,000 lists counted as one, and the
    save refused the state as sharing a list under 2,000 paths."""
    state = {"table": _Table(2_000, 1, 2_000)}
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig(weights_only=False))
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "ck"), {"model": state})
        loaded = manager.load(str(tmp_path / "ck"))["model"]
    assert isinstance(loaded["table"], _Table) and len(loaded["table"]) == 2_000


class _Tree(Mapping[str, Any]):
    """A read-only view of `depth` levels, made at each access, over plain JSON data at its bottom."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __getitem__(self, key: str) -> Any:
        return _Tree(self.depth - 1) if self.depth else {"leaf": key}

    def __iter__(self) -> Iterator[str]:
        return iter(("a", "b", "c"))

    def __len__(self) -> int:
        return 3


def _as_dicts(value: Any) -> Any:
    return {k: _as_dicts(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def test_a_json_item_of_values_made_at_each_access_is_no_cycle(tmp_path: Path) -> None:
    layout = LayoutInfo("misc.json", JsonSerialization())
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), items={"misc": ItemSpec(layout=layout)})
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "ck"), {"misc": _Tree(6)})  # was: NestingError "contains itself"
        loaded = manager.load(str(tmp_path / "ck"))["misc"]
    assert loaded == _as_dicts(_Tree(6))


# ------------------------------------------------------------- what a value the walk does not enter shares
#
# A save walks dicts, lists and tuples and takes every other value whole (a set, a deque, an object of the
# caller's). torch.save pickles an item whole, so a list or tensor reachable both from the tree and from inside
# such a value loads back as one object. The async save's staging copy rebuilt the tree's containers and
# deep-copied each whole value on its own, and a sync save whose item held a tensor needing its written form
# (a Parameter) rebuilt the tree and kept the whole values as they were: either way the two places loaded back
# as two objects (a tensor tied under two keys as two tensors).


class Holder:
    """An object of the caller's, holding a list and a tensor that the state also holds under its own keys."""

    def __init__(self, items: list[Any], weight: torch.Tensor) -> None:
        self.items, self.weight = items, weight


def _opaque_state(with_parameter: bool) -> dict[str, Any]:
    pair = (torch.arange(3.0), torch.ones(2))
    items, weight = [1, [2, 3]], torch.full((4,), 5.0)
    state: dict[str, Any] = {
        "seen": {pair},  # met (walked) before the tree's own "pair": the copy of the set comes first
        "pair": pair,
        "items": items,
        "weight": weight,
        "later": deque([items, weight]),  # met after the tree's own: the tree's copies come first
        "holder": Holder(items, weight),
    }
    if with_parameter:
        state["p"] = torch.nn.Parameter(torch.ones(2))  # needs its written form: a sync save rebuilds the tree
    return state


def _opaque_sharing(value: dict[str, Any]) -> dict[str, bool]:
    (pair,) = value["seen"]
    return {
        "set's tuple is pair": pair is value["pair"],
        "set's tensor is pair's": pair[0] is value["pair"][0],
        "deque's list is items": value["later"][0] is value["items"],
        "deque's tensor is weight": value["later"][1] is value["weight"],
        "holder's list is items": value["holder"].items is value["items"],
        "holder's tensor is weight": value["holder"].weight is value["weight"],
    }


def _torch_saved(value: Any) -> Any:
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize(("mode", "with_parameter"), [("async", False), ("async", True), ("sync", True)])
def test_what_a_whole_value_shares_with_the_tree_loads_back_shared(
    tmp_path: Path, mode: str, with_parameter: bool
) -> None:
    state = _opaque_state(with_parameter)
    assert all(_opaque_sharing(_torch_saved(state)).values())  # as torch.save keeps it
    save = AsyncCheckpointSaverConfig() if mode == "async" else SyncCheckpointSaverConfig()
    config = CheckpointManager.Config(save=save, load=CheckpointLoaderConfig(weights_only=False))
    with CheckpointManager(config) as manager:
        future = manager.save(str(tmp_path / "ck"), {"model": state})
        if future is not None:
            future.result(timeout=120)
        loaded = manager.load(str(tmp_path / "ck"))["model"]
    assert _opaque_sharing(loaded) == dict.fromkeys(_opaque_sharing(loaded), True)
    assert torch.equal(loaded["pair"][0], torch.arange(3.0)) and torch.equal(loaded["weight"], torch.full((4,), 5.0))
    assert loaded["items"] == [1, [2, 3]] and type(loaded["later"]) is deque


def test_a_whole_value_shares_the_staged_copy_not_the_callers_tensor(tmp_path: Path) -> None:
    """The staged copy is what the write reads: a tensor both in the tree and inside a whole value is the
    staged one in both places, so a change after save() returns reaches neither (requires_copy=True)."""
    state = _opaque_state(with_parameter=False)
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(), load=CheckpointLoaderConfig(weights_only=False)
    )
    with CheckpointManager(config) as manager:
        future = manager.save(str(tmp_path / "ck"), {"model": state})
        state["weight"].fill_(-1.0)
        state["items"].append(4)
        assert future is not None
        future.result(timeout=120)
        loaded = manager.load(str(tmp_path / "ck"))["model"]
    assert torch.equal(loaded["holder"].weight, torch.full((4,), 5.0)) and loaded["holder"].items == [1, [2, 3]]


class _FreshRows(Mapping[int, torch.Tensor]):
    """A view whose tensors are made at each access, in memory of their own (nothing else holds one). The save
    cannot rebuild it from its items (its constructor takes two arguments): it is saved as a plain dict."""

    def __init__(self, rows: int, scale: float) -> None:
        self.rows, self.scale = rows, scale

    def __getitem__(self, key: int) -> torch.Tensor:
        return torch.full((3,), key * self.scale)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rows))

    def __len__(self) -> int:
        return self.rows


def test_tensors_made_at_each_access_are_each_staged_as_themselves(tmp_path: Path) -> None:
    """The staging copy finds a tensor's slot by the memory it views: one made again at the copy (other memory
    than when the slots were planned) must still be saved as its own values, never as another one's slot."""
    state = {"rows": _FreshRows(8, 1.0), "w": torch.ones(2)}
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(), load=CheckpointLoaderConfig(weights_only=False)
    )
    with CheckpointManager(config) as manager:
        for step in (1, 2):  # the second save reuses the slab laid out by the first
            future = manager.save(str(tmp_path / f"ck{step}"), {"model": state})
            assert future is not None
            future.result(timeout=120)
            loaded = manager.load(str(tmp_path / f"ck{step}"))["model"]
            assert [v.tolist() for v in loaded["rows"].values()] == [[float(i)] * 3 for i in range(8)]
