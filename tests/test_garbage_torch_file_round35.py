"""A Torch file whose bytes are no pickle is damage, not an object the safe loader refused (round 35).

Garbage in an item's file (its manifest checksum made to match) was a RefusedPickleError whose hint offered
`weights_only=False`: a user told to switch the safety off for a file that is simply corrupt. A pickle naming a
global the safe loader refuses keeps that refusal and its trust hint.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from tests.crafted_files import replace_item_file
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError, RefusedPickleError


class _NotAllowed:
    """A class torch's safe loader does not know."""


def _config() -> CheckpointManager.Config:
    return CheckpointManager.Config(save=SyncCheckpointSaverConfig())


def _saved(tmp_path: Path) -> Path:
    checkpoint = tmp_path / "step_1"
    with CheckpointManager(_config()) as manager:
        manager.save(str(checkpoint), {"model": {"w": torch.ones(3)}})
    return checkpoint


def _damaged_pickle() -> bytes:
    """A real Torch file whose data.pkl holds a byte that is no pickle opcode."""
    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    data = bytearray(buf.getvalue())
    start = data.index(b"\x80\x02", data.index(b"data.pkl"))
    data[start + 2] = 0xFF
    return bytes(data)


@pytest.mark.parametrize(
    "data", [b"garbage, not a torch file " * 8, b"not a torch file " * 8, _damaged_pickle()], ids=["get", "text", "pkl"]
)
def test_bytes_that_are_no_pickle_are_damage(tmp_path: Path, data: bytes) -> None:
    checkpoint = _saved(tmp_path)
    path = replace_item_file(checkpoint, data)
    with CheckpointManager(_config()) as manager, pytest.raises(CorruptCheckpointError) as refused:
        manager.load(str(checkpoint))
    said = str(refused.value)
    assert not isinstance(refused.value, RefusedPickleError), said
    assert "weights_only=False" not in said and "add_safe_globals" not in said, said
    assert str(path) in said and "item 'model'" in said, said


def test_a_refused_global_keeps_the_trust_hint(tmp_path: Path) -> None:
    checkpoint = _saved(tmp_path)
    buf = io.BytesIO()
    torch.save({"w": _NotAllowed()}, buf)
    replace_item_file(checkpoint, buf.getvalue())
    with CheckpointManager(_config()) as manager, pytest.raises(RefusedPickleError, match="weights_only=False"):
        manager.load(str(checkpoint))
