"""A save warns when a dict KEY is of a type the default (safe) load refuses, as it warns for a value (round 32).

The safe-load check judged every value and container of a torch item, never a dict's keys, which the file
pickles just as well: `{np.int64(1): t}` (a layer index computed with numpy) was saved without a word, and every
default load of the checkpoint raised `RefusedPickleError` ("Unsupported global: numpy._core.multiarray.scalar").
Round 31 made any dict key a path component; this makes the keys' types as safe to save as the values'.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import RefusedPickleError

ABOUT = "which the default load of this checkpoint will refuse"


def _save(path: Path, payload: dict[str, Any]) -> tuple[CheckpointManager, list[str]]:
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(str(path), payload)
    return manager, [str(w.message) for w in caught if ABOUT in str(w.message)]


@pytest.mark.parametrize("key", [np.int64(1), (2, np.int32(3)), "own-class"], ids=["np.int64", "in-tuple", "own-class"])
def test_a_dict_key_the_default_load_refuses_is_named_at_save(tmp_path: Path, key: Any) -> None:
    """Defect: no warning; the load raised RefusedPickleError."""
    if key == "own-class":
        key = _Hashable()
    manager, said = _save(tmp_path / "ck", {"m": {"a": {key: torch.ones(2)}}})
    try:
        assert len(said) == 1, said
        assert "'m::a'" in said[0] and "dict key" in said[0] and "add_safe_globals" in said[0]
        with pytest.raises(RefusedPickleError):  # what the warning foretold
            manager.load(str(tmp_path / "ck"))
    finally:
        manager.close()


class _Hashable:
    """A key of the caller's own class, which the safe unpickler does not know."""


def test_plain_keys_say_nothing(tmp_path: Path) -> None:
    manager, said = _save(tmp_path / "ck", {"m": {"a": {1: torch.ones(2), "b": 2, (1, "x"): 3, None: 4, 1.5: 5}}})
    manager.close()
    assert said == []
