"""Public entry points refuse a wrong kind of argument with a `ConfigTypeError` that names it, round 27.

API_SURFACE §2.2 takes `CheckpointManager(config: Config | None = None)`; `latest_checkpoint` and
`list_checkpoints` take an optional `Storage`. A wrong object there (a dict of fields, a preset not called, a
saver config, a StorageConfig where its storage was meant) failed deep inside with an `AttributeError` naming
an attribute the caller never used, or with a `ConfigTypeError` about a field (`Config.items ... got
builtin_function_or_method`) the caller never set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigTypeError

_CONFIG_MISTAKES: dict[str, tuple[Any, str]] = {
    "a dict of its fields": ({"items": {}}, r"got dict.*CheckpointManager\.Config\(\*\*fields\)"),
    "a preset not called": (CheckpointManager.Config.with_sync_save, r"with_sync_save\(\)"),
    "the Config class itself": (CheckpointManager.Config, r"an instance.*CheckpointManager\.Config\(\)"),
    "a saver config": (SyncCheckpointSaverConfig(), r"got SyncCheckpointSaverConfig.*Config\(save=\.\.\.\)"),
    "a directory": ("runs/ckpt", r"got str.*checkpoint id"),
}


@pytest.mark.parametrize("mistake", sorted(_CONFIG_MISTAKES))
def test_a_manager_built_from_something_other_than_a_config_is_refused_naming_the_argument(mistake: str) -> None:
    """Before: AttributeError "'str' object has no attribute 'items'" (a path, a preset not called, a saver
    config), or ConfigTypeError "Config.items must be a Mapping ..., got builtin_function_or_method" (a dict)."""
    value, fix = _CONFIG_MISTAKES[mistake]
    with pytest.raises(ConfigTypeError, match=r"^CheckpointManager\(config=\.\.\.\) must be a CheckpointManager\.Conf"):
        CheckpointManager(value)
    with pytest.raises(ConfigTypeError, match=fix):
        CheckpointManager(value)


def test_a_config_subclass_is_still_a_config(tmp_path: Path) -> None:
    class Mine(CheckpointManager.Config):
        pass

    with CheckpointManager(Mine(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "a"), {"step": 1})
        assert manager.load(str(tmp_path / "a"), into={"step": None}) == {"step": 1}
