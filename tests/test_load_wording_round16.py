"""Load wording found in round 16, each with the test that failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager


@pytest.mark.parametrize("with_into", [False, True], ids=["self-describing", "into"])
def test_a_missing_checkpoint_is_named_as_the_api_surface_says_with_or_without_into(
    tmp_path: Path, with_into: bool
) -> None:
    """API_SURFACE §2.4.4: "Checkpoint directory missing → FileNotFoundError("Checkpoint path <id> does not
    exist.")". A load without into= (the manifest describes the items) said "<id>: no such directory." instead."""
    missing = tmp_path / "step7"
    manager = CheckpointManager()
    kwargs = {"into": {"w": torch.zeros(2)}} if with_into else {}
    with pytest.raises(FileNotFoundError) as caught:
        manager.load(str(missing), **kwargs)
    assert str(caught.value).startswith(f"Checkpoint path {missing} does not exist."), str(caught.value)
