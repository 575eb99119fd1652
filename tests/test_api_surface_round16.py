"""API_SURFACE §2.x/§3.x rules checked through the manager, round 16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError, CorruptCheckpointError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def _manager() -> CheckpointManager:
    return CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        items={"st": ItemSpec(layout=LayoutInfo("st.safetensors", SafetensorsSerialization()))},
    ).build()


def test_a_bad_safetensors_map_location_is_a_usage_error_not_a_damaged_file(tmp_path: Path) -> None:
    """§2.4.8: Safetensors files accept only str/torch.device, anything else ->
    `ValueError("SafetensorsSerialization map_location must be a str or torch.device, got <type>...")`.
    Defect: through `load` the refusal came back as an `UndecodableFileError` saying the intact file was
    "damaged or crafted" and advising to load an earlier checkpoint."""
    mgr = _manager()
    try:
        mgr.save(str(tmp_path / "c"), {"st": {"w": torch.ones(2)}})
        with pytest.raises(
            ValueError, match="SafetensorsSerialization map_location must be a str or torch.device, got function"
        ) as info:
            mgr.load(str(tmp_path / "c"), {"st": None}, map_location=lambda s, _loc: s)
        assert isinstance(info.value, ConfigError), type(info.value)
        assert not isinstance(info.value, CorruptCheckpointError), str(info.value)
        assert "'st'" in str(info.value)
        assert "damaged" not in str(info.value)
        assert mgr.load(str(tmp_path / "c"), {"st": None}, map_location="cpu")["st"]["w"].tolist() == [1.0, 1.0]
    finally:
        mgr.close()
