"""`Config.with_sync_save()` / `with_async_save()` called on a config (round 27).

API_SURFACE §5 makes the presets classmethods: on the class they give a config whose other fields are all
default, and that stays. Called on a config, `Config(items=...).with_sync_save()` reads as "this config, saved
synchronously", but a classmethod ignores the instance: the items, layouts and retention the user set were
dropped, silently, and every later save wrote the default layouts."""

from __future__ import annotations

import inspect
import pickle

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


@pytest.mark.parametrize("name", sorted(_PRESETS))
def test_a_preset_stays_a_classmethod_that_pickles_and_compares(name: str) -> None:
    """API_SURFACE §5 names the presets classmethods: a preset taken from the class (a factory handed to a
    spawned process, a functools.partial, a launch's args) pickled and compared equal as a bound classmethod
    does. Made as a new closure at each attribute access, it no longer pickled ("not the same object as
    ...Config.with_sync_save") and was never equal to itself."""
    on_class = getattr(CheckpointManager.Config, name)
    made = pickle.loads(pickle.dumps(on_class))()
    assert type(made.save) is _PRESETS[name] and made.items == {}
    assert on_class == getattr(CheckpointManager.Config, name) and inspect.ismethod(on_class)
    assert isinstance(inspect.getattr_static(CheckpointManager.Config, name), classmethod)
    config = CheckpointManager.Config(items={"misc": ItemSpec(requires_copy=False)}, default=None)
    from_copy = pickle.loads(pickle.dumps(getattr(config, name)))()  # bound to (a copy of) that config
    assert type(from_copy.save) is _PRESETS[name]
    assert from_copy.items == config.items and from_copy.default is None
