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

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
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
