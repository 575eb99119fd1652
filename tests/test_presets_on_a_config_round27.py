"""`Config.with_sync_save()` / `with_async_save()` called on a config (round 27).

API_SURFACE §5 makes the presets classmethods: on the class they give a config whose other fields are all
default, and that stays. Called on a config, `Config(items=...).with_sync_save()` reads as "this config, saved
synchronously", but a classmethod ignores the instance: the items, layouts and retention the user set were
dropped, silently, and every later save wrote the default layouts."""

from __future__ import annotations

import inspect

import pytest

from torch_checkpointing import (
    AsyncCheckpointSaverConfig,
    CheckpointManager,
    ItemSpec,
    RetentionPolicy,
    SyncCheckpointSaverConfig,
)
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo

_PRESETS = {"with_sync_save": SyncCheckpointSaverConfig, "with_async_save": AsyncCheckpointSaverConfig}


@pytest.mark.parametrize("name", sorted(_PRESETS))
def test_a_preset_called_on_a_config_keeps_its_fields(name: str) -> None:
    items = {"misc": ItemSpec(requires_copy=False, layout=LayoutInfo("misc.json", JsonSerialization()))}
    retention = RetentionPolicy(keep_last=2)
    config = CheckpointManager.Config(items=items, default=None, retention=retention)
    made = getattr(config, name)()
    assert type(made.save) is _PRESETS[name]
    assert made.items is items and made.default is None and made.retention is retention
    assert type(config.save) is AsyncCheckpointSaverConfig and made is not config  # the config itself unchanged


@pytest.mark.parametrize("name", sorted(_PRESETS))
def test_a_preset_called_on_the_class_gives_every_other_field_its_default(name: str) -> None:
    made = getattr(CheckpointManager.Config, name)()
    assert type(made.save) is _PRESETS[name]
    assert made.items == {} and made.retention is None and made.default == CheckpointManager.Config().default
    assert inspect.signature(getattr(CheckpointManager.Config, name)).parameters == {}
    assert "synchronous" in (getattr(CheckpointManager.Config, name).__doc__ or "")
