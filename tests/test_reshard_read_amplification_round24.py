"""How many bytes a resharding load reads from a local source (round 24).

The copy phase reads each block again and checks it as it copies (the bytes copied are the bytes checked),
extending each tensor's read to the whole blocks it touches. Reading every block again for every tensor in it
made a source of many small tensors (100 KB each, 256 KiB blocks) read about seven times its size. Checked
blocks of the ends of a read are kept in memory (as an object store's are), so the next tensor in the same block
is cut out of them: the load reads about twice its size (once to check, once to copy).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec, read_context
from torch_checkpointing.dtensor_resharder import DTensorResharder


class AlwaysReshard(DTensorResharder):
    """Reshards a plain tensor too, so one process exercises the resharding read path."""

    def should_reshard(self, source_metadata: Any, target_metadata: Any) -> bool:
        return source_metadata is not None and target_metadata is not None


def test_a_source_of_many_small_tensors_is_read_about_twice_not_once_per_tensor_per_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CheckpointManager.Config.with_sync_save()
    config.items = {"model": ItemSpec(resharder=AlwaysReshard())}
    with CheckpointManager(config) as manager:
        state = {f"t{i}": torch.full((25_000,), float(i)) for i in range(200)}  # 100 KB each
        manager.save(str(tmp_path / "ck"), {"model": state})
        size = os.path.getsize(tmp_path / "ck" / "model_0.pt")
        read: list[int] = []
        real = read_context._pread_buffer

        def spy(fd: int, offset: int, length: int, where: str = "File") -> bytearray:
            read.append(length)
            return real(fd, offset, length, where)

        monkeypatch.setattr(read_context, "_pread_buffer", spy)
        template = {key: torch.zeros(25_000) for key in state}
        manager.load(str(tmp_path / "ck"), {"model": template})
    assert all(torch.equal(template[key], state[key]) for key in state)
    assert sum(read) <= 2.5 * size, f"read {sum(read) / size:.2f} times the source's {size} bytes"
