"""API_SURFACE §3 rules checked through the manager, round 17."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def _manager(default: ItemSpec | None) -> CheckpointManager:
    return CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        items={"model": ItemSpec()},
        default=default,
    ).build()


def test_the_schema_reports_a_missing_required_item_before_an_invalid_key(tmp_path: Path) -> None:
    """§3 resolves a payload "in this order": required items (KeyError), then the strict schema's unknown keys
    (KeyError), and key validation "later". Defect: a payload holding an invalid key and lacking a required item
    raised the key's ValueError, so code catching the documented KeyError for a missing item saw another error."""
    with _manager(ItemSpec()) as manager:
        with pytest.raises(KeyError, match=r"Missing required checkpoint item\(s\): \['model'\]"):
            manager.save(str(tmp_path / "a"), {"bad.key": 1})
        with pytest.raises(KeyError, match=r"Missing required checkpoint item\(s\): \['model'\]"):
            manager.load(str(tmp_path / "a"), into={"bad.key": None})
    assert not (tmp_path / "a").exists()


def test_the_strict_schema_reports_an_unknown_key_before_validating_it(tmp_path: Path) -> None:
    with (
        _manager(None) as manager,
        pytest.raises(KeyError, match=r"No ItemSpec for checkpoint key\(s\) \['bad\.key'\]"),
    ):
        manager.save(str(tmp_path / "a"), {"model": torch.ones(1), "bad.key": 1})
    assert not (tmp_path / "a").exists()


def test_an_invalid_key_with_every_required_item_present_is_still_refused_by_the_key_rule(tmp_path: Path) -> None:
    with _manager(ItemSpec()) as manager:
        with pytest.raises(ValueError, match=r"Invalid checkpoint keys \['bad\.key'\]"):
            manager.save(str(tmp_path / "a"), {"model": torch.ones(1), "bad.key": 1})
        with pytest.raises(TypeError, match="keys must be str"):
            manager.save(str(tmp_path / "a"), {"model": torch.ones(1), 3: 1})  # type: ignore[dict-item]
    assert not (tmp_path / "a").exists()
