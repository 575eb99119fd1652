"""A value taken whole whose staging copy does not pickle is refused in words that name the cause: the copy of a
value, not a tensor.

Before, an async save of such a value (requires_copy=True) failed while the staged tree was turned into slab
references, and the error said "(a tensor the staging slab cannot hold travels by value)" and "Make it picklable
(an mkldnn tensor: .to_dense())", for an object holding a lock, whether or not the save held any tensor. The
writer's own refusal of a value that does not pickle says why (requires_copy=True values are deep-copied) and
gives a way out (with_sync_save()).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

# A Handle is a class torch's safe loader refuses: the save warns so, beside the refusal tested here.
pytestmark = pytest.mark.filterwarnings("ignore:Item 'extra..h' holds")


class LockedCopy:
    """What `Handle` copies itself into: an object holding a lock, which no pickle takes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


class Handle:
    """Pickles (the plan's look finds nothing wrong), but its deep copy holds a lock."""

    def __deepcopy__(self, memo: dict[int, Any]) -> LockedCopy:
        return LockedCopy()


@pytest.fixture
def manager() -> Iterator[CheckpointManager]:
    """One per test: a manager's staging slab outlives the save that made it."""
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    with CheckpointManager(config) as m:
        yield m


def _refusal(manager: CheckpointManager, path: Path, payload: dict[str, Any]) -> str:
    future = manager.save(str(path), payload)
    assert future is not None
    with pytest.raises(pickle.PicklingError) as info:
        future.result(timeout=120)
    assert not path.exists()
    return str(info.value)


@pytest.mark.parametrize("with_slab", [True, False], ids=["beside-tensors", "alone"])
def test_a_copy_that_does_not_pickle_is_named_as_a_copy_not_a_tensor(
    manager: CheckpointManager, tmp_path: Path, with_slab: bool
) -> None:
    payload: dict[str, Any] = {"extra": {"h": Handle()}}
    if with_slab:
        payload["model"] = {"w": torch.ones(3)}
    said = _refusal(manager, tmp_path / "ck", payload)
    assert "Item 'extra' cannot be pickled for the async writer process" in said
    assert "'extra::h'" in said and "LockedCopy" in said and "_thread.lock" in said
    assert "deep-copied" in said and "with_sync_save()" in said  # why it failed here, and a way out
    assert "tensor" not in said and "mkldnn" not in said


def test_an_mkldnn_tensor_keeps_its_own_fix(manager: CheckpointManager, tmp_path: Path) -> None:
    """The tensor wording stays for the tensor it was written for."""
    said = _refusal(manager, tmp_path / "ck", {"model": {"w": torch.ones(3), "t": torch.ones(2).to_mkldnn()}})
    assert "Item 'model'" in said and ".to_dense()" in said
