"""Whether an item file's bytes are damage or a pickle the safe loader refused is decided from the bytes (round 36).

The decision read torch's own error text (a regex on "Unsupported operand N"): a pickle torch's safe unpickler does
not read but the unsafe loader does (one written with `pickle_protocol=4`) was called damage that "no loader, safe
or not, reads", and a torch release rewording its errors would turn damage into a refusal hinting
`weights_only=False`. Now the bytes decide: a zip's data.pkl, or a legacy file's pickles, walked opcode by opcode
(nothing is run).
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
import torch

from tests.crafted_files import replace_item_file
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError, RefusedPickleError


class _NotAllowed:
    """A class torch's safe loader does not know."""


def _config(weights_only: bool = True) -> CheckpointManager.Config:
    return CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig(weights_only=weights_only)
    )


def _torch_bytes(value: object, **options: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf, **options)  # type: ignore[arg-type]
    return buf.getvalue()


def _checkpoint_holding(tmp_path: Path, data: bytes) -> tuple[Path, Path]:
    """A saved checkpoint whose item file holds `data`, its record's size and checksum made to match."""
    checkpoint = tmp_path / "step_1"
    with CheckpointManager(_config()) as manager:
        manager.save(str(checkpoint), {"model": {"w": torch.ones(3)}})
    return checkpoint, replace_item_file(checkpoint, data)


def _random_bytes() -> bytes:
    data = random.Random(36).randbytes(4096)
    return data if data[:1] != b"\x80" else b"\x00" + data[1:]


_INTACT = _torch_bytes({"w": torch.ones(3)})
_LEGACY = _torch_bytes({"w": torch.ones(3)}, _use_new_zipfile_serialization=False)
_DAMAGE = {
    "truncated_zip": _INTACT[: len(_INTACT) // 2],
    "random": _random_bytes(),
    "truncated_legacy": _LEGACY[:60],
    "legacy_cut_in_its_value": _LEGACY[: _LEGACY.index(b"_rebuild_tensor_v2") + 4],
}
_REFUSED = {
    "global": _torch_bytes({"w": _NotAllowed()}),
    "legacy_global": _torch_bytes({"w": _NotAllowed()}, _use_new_zipfile_serialization=False),
    "protocol_4": _torch_bytes({"w": torch.ones(3)}, pickle_protocol=4),
}


@pytest.mark.parametrize("weights_only", [True, False], ids=["safe", "unsafe"])
@pytest.mark.parametrize("name", sorted(_DAMAGE))
def test_damaged_bytes_are_damage(tmp_path: Path, name: str, weights_only: bool) -> None:
    checkpoint, path = _checkpoint_holding(tmp_path, _DAMAGE[name])
    with CheckpointManager(_config(weights_only)) as manager, pytest.raises(CorruptCheckpointError) as refused:
        manager.load(str(checkpoint))
    said = str(refused.value)
    assert not isinstance(refused.value, RefusedPickleError), said
    assert "weights_only=False" not in said and "add_safe_globals" not in said, said
    assert str(path) in said, said


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_a_pickle_the_safe_loader_refuses_keeps_the_trust_hint(tmp_path: Path, name: str) -> None:
    checkpoint, path = _checkpoint_holding(tmp_path, _REFUSED[name])
    with CheckpointManager(_config()) as manager, pytest.raises(RefusedPickleError) as refused:
        manager.load(str(checkpoint))
    said = str(refused.value)
    assert "weights_only=False" in said and str(path) in said and "item 'model'" in said, said
    with CheckpointManager(_config(weights_only=False)) as manager:  # what the hint offers reads it
        assert "w" in manager.load(str(checkpoint))["model"]


def test_an_intact_legacy_file_loads(tmp_path: Path) -> None:
    checkpoint, _ = _checkpoint_holding(tmp_path, _LEGACY)
    with CheckpointManager(_config()) as manager:
        assert torch.equal(manager.load(str(checkpoint))["model"]["w"], torch.ones(3))
