"""Engine leftovers: `~` in the staging directory, and the build-time check of long file names at the
largest rank of the world."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.checkpoint_manager import _warn_refused_layouts
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.schema import check_names_fit
from torch_checkpointing.traversal import nan_key_path, tree_sizes, walk_sizes

# One name that fits with ranks 0..9 (255 bytes at most) and not with rank 10 (256 bytes).
_LONG_FILE = "x" * 254 + "{rank}"
_LONG_KEY = "k" * 250  # the default '<key>_<rank>.pt': 255 bytes at rank 9, 256 at rank 10


@pytest.mark.parametrize("world_size", [1, 10])
def test_a_name_that_fits_at_every_rank_passes(world_size: int) -> None:
    check_names_fit("a", LayoutInfo(_LONG_FILE, TorchSerialization()), world_size)


@pytest.mark.parametrize("world_size", [11, 100])
def test_a_name_too_long_at_the_largest_rank_is_refused(world_size: int) -> None:
    """A name that fits at rank 0 but not at rank world_size - 1 is refused by every save at that world size;
    it was checked with rank 0 only, so the manager said nothing when built."""
    with pytest.raises(ConfigError, match="256 bytes"):
        check_names_fit("a", LayoutInfo(_LONG_FILE, TorchSerialization()), world_size)


@pytest.mark.parametrize(
    "config",
    [
        CheckpointManager.Config(items={"a": ItemSpec(layout=LayoutInfo(_LONG_FILE, TorchSerialization()))}),
        CheckpointManager.Config(items={_LONG_KEY: ItemSpec()}),  # the default '<key>_<rank>.pt'
    ],
    ids=["layout", "default-layout"],
)
def test_manager_build_warns_with_the_world_size(
    config: CheckpointManager.Config, caplog: pytest.LogCaptureFixture
) -> None:
    """The manager's build-time warning judges names at the largest rank of the world it runs in."""
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        _warn_refused_layouts(config, 10)
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        _warn_refused_layouts(config, 11)
    assert [r for r in caplog.records if "every save() of this item will be refused" in r.getMessage()]


_NAN = float("nan")
_SHARED = {"s": 1, _NAN: 2}
_CYCLE: list[object] = [{"a": 1}]
_CYCLE.append(_CYCLE)


@pytest.mark.parametrize(
    "value",
    [
        {"m": {"w": torch.ones(1)}, "o": {"state": {0: {"step": 1}}, "groups": [{"params": [0]}]}},
        {_NAN: 1},
        {"a": [{"b": 1, _NAN: 2}]},
        {(1, _NAN): 3},
        {(1, 2.5): 3, math.inf: 4, "x": [{-0.0: 1}]},
        {"one": _SHARED, "two": [_SHARED, (_SHARED,)]},
        {"c": _CYCLE},
        [[{"deep": {"deeper": {(_NAN, "t"): 0}}}]],
        torch.ones(2),
    ],
    ids=["adam-like", "top", "nested", "tuple-key", "no-nan", "shared", "cycle", "deep", "leaf"],
)
def test_the_saves_one_walk_finds_what_the_two_did(value: object) -> None:
    """The writer's encode walks a torch item once (`tree_sizes`) where it walked it twice (`walk_sizes`, then
    `nan_key_path`): the one walk must count the same and find a NaN key wherever the path search does."""
    assert tree_sizes(value, nan_keys=True) == (*walk_sizes(value), nan_key_path(value) is not None)
    assert tree_sizes(value, nan_keys=False) == (*walk_sizes(value), False)
