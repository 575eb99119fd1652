"""A template container the load cannot rebuild as its own type comes back as a plain one, and the warning names
the template entry (it read `<unnamed path>`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager


class Pair(tuple):  # type: ignore[type-arg]
    """A tuple type whose constructor takes two arguments, not one iterable: nothing can rebuild it from items."""

    def __new__(cls, a: Any, b: Any) -> Pair:
        return super().__new__(cls, (a, b))


def test_the_warning_for_a_template_container_rebuilt_plain_names_its_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as m:
        m.save(str(tmp_path / "ck"), {"state": {"pair": (torch.ones(2), 3)}})
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            out = m.load(str(tmp_path / "ck"), into={"state": {"pair": Pair(torch.zeros(2), 0)}})
    assert list(out["state"]["pair"]) == [out["state"]["pair"][0], 3]
    assert torch.equal(out["state"]["pair"][0], torch.ones(2))
    warned = [r.getMessage() for r in caplog.records if "Pair" in r.getMessage()]
    assert warned and all("state::pair" in m for m in warned), warned
