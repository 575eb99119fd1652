"""Promises of docs/guide.md and docs/durability.md held to by the real engine.

guide.md's error table: "a layout path or format that every save will refuse is also named in a WARNING when the
manager is built". A layout whose file name is over the 255-byte limit of a name (with the shortest rank, '0',
in place of `{rank}`) is refused by every save, but the manager said nothing when it was built: an async job
learnt of it at its first save, hours into training.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.errors import ConfigError

_LONG_NAMES = {  # item key -> a layout whose name no rank can write (None: the default '<key>_<rank>.pt')
    "file": "x" * 253 + "_{rank}.pt",
    "folder": "d" * 256 + "/model_{rank}.pt",
    "k" * 252: None,
}


def _config(key: str, path: str | None) -> CheckpointManager.Config:
    layout = None if path is None else LayoutInfo(path, TorchSerialization())
    return CheckpointManager.Config(items={key: ItemSpec(requires_copy=False, layout=layout)}).with_sync_save()


@pytest.mark.parametrize(("key", "path"), list(_LONG_NAMES.items()), ids=["file", "folder", "default_layout"])
def test_a_layout_name_over_255_bytes_is_named_when_the_manager_is_built(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str, path: str | None
) -> None:
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        manager = CheckpointManager(_config(key, path))
    try:
        warned = [
            r.getMessage() for r in caplog.records if "every save() of this item will be refused" in r.getMessage()
        ]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        assert f"Config.items[{key!r}]" in warned[0] and "255-byte limit" in warned[0]
        with pytest.raises(ConfigError, match="255-byte limit"):  # the warning says what save() does
            manager.save(str(tmp_path / "c"), {key: {"t": torch.ones(2)}})
        assert not os.path.exists(tmp_path / "c")
    finally:
        manager.close()


def test_a_layout_name_of_255_bytes_is_not_warned_about_and_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = "x" * 250 + "_{rank}.pt"  # 255 bytes on ranks 0-9
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        manager = CheckpointManager(_config("item", path))
    try:
        assert not [r for r in caplog.records if "will be refused" in r.getMessage()]
        manager.save(str(tmp_path / "c"), {"item": {"t": torch.ones(2)}})
        assert (tmp_path / "c" / ("x" * 250 + "_0.pt")).is_file()
    finally:
        manager.close()
