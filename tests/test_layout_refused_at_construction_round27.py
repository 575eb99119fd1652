"""A layout every save() refuses is named when the manager is built (round 27).

API_SURFACE §4 has the refusal at write time, and `save()` keeps it there (conformance LAYOUT-PATH-2 and -3
build the manager first). But an async manager's first save may come hours into training: before, nothing was
said until then. The guide's error table promised such a field is named "before any process starts"."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ConfigError, ItemSpec, SyncCheckpointSaverConfig
from torch_checkpointing.checkpoint_layout import LayoutInfo, RawSerialization, TorchSerialization

_BAD = ["../x.pt", "/abs/x.pt", "", "dir/", "manifest.json", "a/../x.pt"]


@pytest.mark.parametrize("path", _BAD)
def test_a_layout_every_save_refuses_is_warned_about_when_the_manager_is_built(
    tmp_path: Path, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    items = {"model": ItemSpec(layout=LayoutInfo(path, TorchSerialization()))}
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        manager = CheckpointManager(CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig()))
    try:
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("'model'" in m and repr(path) in m and "save()" in m for m in said), said
        with pytest.raises(ConfigError, match="model"):
            manager.save(str(tmp_path / "c1"), {"model": {"w": torch.ones(2)}})
    finally:
        manager.close()


def test_a_default_spec_whose_layout_every_save_refuses_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    default = ItemSpec(layout=LayoutInfo("../{rank}.bin", RawSerialization()))
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        CheckpointManager(CheckpointManager.Config(default=default, save=SyncCheckpointSaverConfig())).close()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("Config.default" in m and "../{rank}.bin" in m and "without its own ItemSpec" in m for m in said), said


def test_good_layouts_are_built_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    items = {
        "model": ItemSpec(layout=LayoutInfo("sub/model_{rank}.pt", TorchSerialization())),
        "misc": ItemSpec(layout=LayoutInfo("misc.bin", RawSerialization())),
    }
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        CheckpointManager(CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig())).close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
