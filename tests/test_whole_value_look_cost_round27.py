"""The async save's look for tensors inside a value taken whole costs no call of the engine's per plain object.

The look pickles the value into nothing to find its tensors (one pass per value and save, in save()'s blocked
time). It called back into Python for every object pickled: each dict, str, int and float of the value.
On a value holding 50,000 small records the look took longer than the staging's deep copy of the value
(0.47 s against 0.39 s), nearly half of what save() blocked.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import torch_checkpointing
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig
from torch_checkpointing.staging import CheckpointStagerConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

ROWS = 20_000
# Where the look and the staging live; the deep copy's memo (traversal.TreeMemo) answers deepcopy once per
# object by design: it is what keeps the value's copy sharing with the tree.
LOOK = tuple(str(Path(torch_checkpointing.__file__).parent / name) for name in ("pickling.py", "staging.py"))


class Records:
    """A value taken whole: a user object holding many plain records and one tensor."""

    def __init__(self, rows: int) -> None:
        self.rows = [{"i": i, "s": str(i), "f": float(i)} for i in range(rows)]
        self.weights = torch.ones(4)


class LookCalls:
    """Counts the calls of the look's and the staging's Python functions made on this thread while it is on."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename in LOOK:
            self.count += 1


def _manager() -> CheckpointManager:
    """Staging on the calling thread (the copy is done when save() returns), so the profile sees it."""
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(staging_config=CheckpointStagerConfig(use_async_staging=False)),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
    )
    return CheckpointManager(config)


@pytest.fixture
def manager() -> Iterator[CheckpointManager]:
    with _manager() as m:
        yield m


def _calls_in_save(manager: CheckpointManager, path: Path, value: Any) -> int:
    calls = LookCalls()
    sys.setprofile(calls)
    try:
        future = manager.save(str(path), {"model": {"w": torch.ones(8)}, "extra": {"records": value}})
    finally:
        sys.setprofile(None)
    assert future is not None
    future.result(timeout=120)
    return calls.count


@pytest.mark.filterwarnings("ignore:Item 'extra..records' holds")
def test_the_look_makes_no_call_per_plain_object_of_a_value_taken_whole(
    manager: CheckpointManager, tmp_path: Path
) -> None:
    assert threading.current_thread() is threading.main_thread()
    _calls_in_save(manager, tmp_path / "warm", Records(10))  # the first save's once-per-type checks
    small = _calls_in_save(manager, tmp_path / "small", Records(10))
    large = _calls_in_save(manager, tmp_path / "large", Records(ROWS))
    # Records(ROWS) holds 4 * ROWS more objects than Records(10); the look's calls must not grow with them.
    assert large - small < ROWS // 10, (small, large)
    with torch.serialization.safe_globals([Records]):
        loaded = manager.load(str(tmp_path / "large"), into={"extra": None})["extra"]["records"]
    assert len(loaded.rows) == ROWS and loaded.rows[-1] == {"i": ROWS - 1, "s": str(ROWS - 1), "f": ROWS - 1.0}
    assert torch.equal(loaded.weights, torch.ones(4))


@pytest.mark.filterwarnings("ignore:Item 'extra..records' holds")
def test_the_hand_over_makes_no_call_per_plain_object_of_a_value_taken_whole(tmp_path: Path) -> None:
    """After save() returns, the comm thread turns the staged tree into what travels to the writer, and looked
    through each staged value taken whole again (for slab tensors, and the tree's containers) the same way:
    one call into Python per object, holding the GIL the training loop wants, before the writer got the save."""
    calls = LookCalls()
    threading.setprofile(calls)  # the manager's threads, started from here on, count too
    try:
        with _manager() as manager:
            counts = []
            for rows in (10, 10, ROWS):  # the first: the first save's once-per-type checks
                before = calls.count
                future = manager.save(str(tmp_path / f"ck{len(counts)}"), {"extra": {"records": Records(rows)}})
                assert future is not None
                future.result(timeout=120)
                counts.append(calls.count - before)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert counts[2] - counts[1] < ROWS // 10, counts
