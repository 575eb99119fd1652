"""A numpy scalar dict key where a path must be recorded as JSON is refused naming the item and the fix.

Before, a resharded item `{"a": {np.int64(3): dtensor}}` was refused at save with "Nested path ('a',
np.int64(3)) has component np.int64(3) of type int64; only str, int, float ... can be recorded", naming neither
the item nor the conversion that fixes it (`int(key)`), and `CheckpointPath.serialize` said the same.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from torch_checkpointing import CheckpointManager, DTensorResharder, ItemSpec, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.types import CheckpointPath

_KEYS = [
    (np.int64(3), "int(key)"),
    (np.int32(3), "int(key)"),
    (np.float32(1.5), "float(key)"),
    (np.bool_(True), "bool(key)"),
    ((np.int64(3), "a"), "int(key)"),
]
_IDS = ["int64", "int32", "float32", "bool_", "tuple-holding-int64"]


@pytest.mark.parametrize(("key", "fix"), _KEYS, ids=_IDS)
def test_a_resharded_items_numpy_key_is_refused_with_its_conversion(tmp_path: Path, key: object, fix: str) -> None:
    config = CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
    )
    with CheckpointManager(config) as manager, pytest.warns(UserWarning), pytest.raises(ConfigError) as caught:
        manager.save(str(tmp_path / "step_1"), {"model": {"layer": {key: torch.ones(2)}}})
    assert fix in str(caught.value), str(caught.value)
    assert "'model'" in str(caught.value), str(caught.value)
    assert list_checkpoints(tmp_path) == []


@pytest.mark.parametrize(("key", "fix"), _KEYS, ids=_IDS)
def test_serialize_names_the_conversion(key: object, fix: str) -> None:
    with pytest.raises(ConfigError) as caught:
        CheckpointPath("model", ("layer", key)).serialize()  # type: ignore[arg-type]
    assert fix in str(caught.value), str(caught.value)


def test_a_converted_key_saves_and_loads(tmp_path: Path) -> None:
    """The fix the message names works: the int the key stands for is recorded, and loaded back equal."""
    config = CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
    )
    with CheckpointManager(config) as manager, pytest.warns(UserWarning):  # plain tensors recorded as replicated
        manager.save(str(tmp_path / "step_1"), {"model": {"layer": {int(np.int64(3)): torch.ones(2)}}})
        loaded = manager.load(str(tmp_path / "step_1"), into={"model": {"layer": {3: torch.zeros(2)}}})
    assert torch.equal(loaded["model"]["layer"][3], torch.ones(2))


def test_a_plain_items_numpy_key_warning_names_the_conversion(tmp_path: Path) -> None:
    """A torch-saved item takes the key, but the default load refuses it: the warning names `int(key)` beside
    add_safe_globals (it named only add_safe_globals, plain data, or weights_only=False)."""
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig())
    with CheckpointManager(config) as manager, pytest.warns(UserWarning, match="default load") as warned:
        manager.save(str(tmp_path / "step_1"), {"model": {"layer": {np.int64(3): torch.ones(2)}}})
    text = " ".join(str(w.message) for w in warned)
    assert "int(key)" in text, text
