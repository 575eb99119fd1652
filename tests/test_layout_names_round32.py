"""A layout file_path no file system can name (a lone surrogate) is refused naming the item (round 32).

`os.fsencode` writes a str path with "surrogateescape", which carries only the surrogates U+DC80..U+DCFF (the
bytes a non-UTF-8 name decoded to); any other surrogate cannot become bytes. Round 31's name-length check of a
layout, run when a manager is built, encoded the path and raised a bare UnicodeEncodeError from
`CheckpointManager(config)`; before, the save raised it, naming neither the item nor the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec, list_checkpoints
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.errors import ConfigError


def _config(path: str) -> CheckpointManager.Config:
    config = CheckpointManager.Config.with_sync_save()
    config.items = {"m": ItemSpec(layout=LayoutInfo(path, TorchSerialization()))}
    return config


@pytest.mark.parametrize("path", ["a\ud800.pt", "sub\udbff/m.pt"], ids=["high", "in-a-folder"])
def test_a_path_with_a_lone_surrogate_is_warned_at_build_and_refused_at_save(
    tmp_path: Path, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: CheckpointManager(config) raised "UnicodeEncodeError: 'utf-8' codec can't encode character
    '\\ud800' in position 1: surrogates not allowed"."""
    with caplog.at_level("WARNING", logger="torch_checkpointing"):
        manager = CheckpointManager(_config(path))
    try:
        assert any("Config.items['m']" in r.getMessage() and "surrogate" in r.getMessage() for r in caplog.records)
        with pytest.raises(ConfigError, match=r"key 'm'.*surrogate"):
            manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}})
    finally:
        manager.close()
    assert list_checkpoints(tmp_path) == []


def test_a_non_utf8_name_a_file_system_holds_is_still_taken(tmp_path: Path) -> None:
    """'\\udcff' is the byte 0xff of a name that is no UTF-8: os.fsencode gives it back, and Linux takes it."""
    with CheckpointManager(_config("m\udcff.pt")) as manager:
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}})
        assert torch.equal(manager.load(str(tmp_path / "ck"))["m"]["x"], torch.ones(2))
    assert (tmp_path / "ck" / "m\udcff.pt").exists()
