"""`memory://` (fsspec's MemoryFileSystem) puts a file under its name at its open, empty, and it grows as it is
written: a reader in the same process (the only one that sees that store) may find any file of a save half
written. Does any reader take such a file for part of a checkpoint?

No: on a store without rename the save writes under the id only with its claim (`.incomplete`) up, which owns the
manifest it writes (`Claim.owns`), and removes the claim only once the manifest is whole. At every open and every
write of every file of a save (its data files, its metadata, its manifest, the manifest written whole or streamed
in parts), the readers see only the checkpoint committed before it: the listing, `latest_checkpoint`, a load of
the id (refused), a load of the latest. This test shows it; nothing was changed for it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import latest_checkpoint, list_checkpoints
from torch_checkpointing.errors import CheckpointError

pytest.importorskip("fsspec")

_seen: list[str] = []  # the file (and how far it was written) at each reader's look


def _look(url: str, path: str, how: str) -> None:
    """What a reader thread sees at this moment of the save of `step_1`: only `step_0`, whole."""
    _seen.append(f"{os.path.basename(path)} {how}")
    storage = FsspecStorageConfig(url=url).create_storage()
    assert [Path(i.path).name for i in list_checkpoints(url, storage)] == ["step_0"], _seen[-1]
    latest = latest_checkpoint(url, storage)
    assert latest is not None and Path(latest.path).name == "step_0", _seen[-1]
    manager = CheckpointManager(
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
    )
    with manager:
        with pytest.raises((CheckpointError, FileNotFoundError)):
            manager.load("step_1")
        assert torch.equal(manager.load("step_0")["model"]["w"], torch.arange(1000.0)), _seen[-1]


class _LookedAtFile(MemoryFile):
    url = ""

    def write(self, data: Any) -> int:
        done = super().write(data)
        _look(self.url, self.path, f"after {self.tell()} bytes")
        return done


class _LookedAtMemory(MemoryFileSystem):
    """Readers look at every open for writing (the file there, empty) and every write (partly written)."""

    url = ""
    armed = False

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        opened = super()._open(path, mode, **kwargs)
        if _LookedAtMemory.armed and "w" in mode and os.path.basename(path) != ".incomplete":
            _look(self.url, path, "opened" if not kwargs.get("data") else "written whole")
            if isinstance(opened, MemoryFile) and not kwargs.get("data"):
                opened.__class__ = _LookedAtFile
                _LookedAtFile.url = self.url
        return opened


@pytest.mark.parametrize("part_size", [16 << 20, 64])  # the manifest written whole (one put), or streamed
def test_no_reader_sees_a_file_of_a_save_being_written_to_memory(part_size: int) -> None:
    url = f"memory://r36-{uuid.uuid4().hex[:8]}/run"
    _LookedAtMemory.url = url
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(),
        storage_config=FsspecStorageConfig(url=url, filesystem=_LookedAtMemory(), part_size=part_size),
    )
    _seen.clear()
    with CheckpointManager(config) as manager:
        manager.save("step_0", {"model": {"w": torch.arange(1000.0)}, "step": 0})
        _LookedAtMemory.armed = True
        try:
            manager.save("step_1", {"model": {"w": torch.ones(1000)}, "step": 1})
        finally:
            _LookedAtMemory.armed = False
    looked_at = {entry.split()[0] for entry in _seen}
    assert {"manifest.json", "model_0.pt", "step_0.pt"} <= looked_at, _seen
    assert any(e.startswith("model_0.pt after") for e in _seen), _seen  # a data file seen partly written
    if part_size == 64:
        assert any(e.startswith("manifest.json after") for e in _seen), _seen  # the manifest too
    with CheckpointManager(config) as manager:
        assert torch.equal(manager.load("step_1")["model"]["w"], torch.ones(1000))
