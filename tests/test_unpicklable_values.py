"""A value a save cannot pickle or deep-copy is named: the item, the nested path, its type, and the fix.

Before, a sync save raised torch.save's "TypeError: cannot pickle '_thread.lock' object", and an async save's
deep copy the same, with no word of which item or which entry held the lock.
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

BAD: dict[str, Any] = {
    "lock": threading.Lock(),
    "generator": (i for i in range(3)),
    "lambda": lambda x: x,
}


@pytest.fixture(scope="module", params=["sync", "async"])
def manager(request: pytest.FixtureRequest) -> Iterator[CheckpointManager]:
    sync = request.param == "sync"
    config = CheckpointManager.Config.with_sync_save() if sync else CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    m = CheckpointManager(config)
    yield m
    m.close()


@pytest.mark.parametrize("kind", sorted(BAD))
def test_the_entry_that_cannot_be_saved_is_named(manager: CheckpointManager, tmp_path: Path, kind: str) -> None:
    payload = {"model": {"w": torch.ones(2)}, "extra": {"ok": 1, "nested": [0, {"culprit": BAD[kind]}]}}
    with pytest.raises(pickle.PicklingError, match=r"Item 'extra'.*'extra::nested\.1\.culprit'") as info:
        future = manager.save(str(tmp_path / "ck"), payload)
        if future is not None:
            future.result(timeout=120)
    assert type(BAD[kind]).__name__ in str(info.value)
    assert not (tmp_path / "ck").exists()
