"""`CheckpointManager.Config`, its presets and `build()`, and the manager's method contract (sync schedule)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import MemoryStorageConfig
from tests.probes import memory_maps
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import (
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    CheckpointSaverConfig,
    SyncCheckpointSaverConfig,
)
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

Config = CheckpointManager.Config
ManagerFactory = Callable[..., CheckpointManager]


def test_config_defaults() -> None:
    config = Config()
    assert dict(config.items) == {}
    assert config.default == ItemSpec()
    assert type(config.save) is AsyncCheckpointSaverConfig
    assert type(config.load) is CheckpointLoaderConfig
    assert config.load.use_mmap is True
    assert config.load.weights_only is True
    assert config.storage_config is None


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        Config({"model": ItemSpec()})  # type: ignore[misc]


def test_config_has_slots() -> None:
    config = Config()
    with pytest.raises(AttributeError):
        config.itemz = {}  # type: ignore[attr-defined]
    assert not hasattr(config, "__dict__")


def test_config_default_factories_are_not_shared() -> None:
    a, b = Config(), Config()
    assert a.items is not b.items
    assert a.save is not b.save


def test_presets_differ_only_in_saver() -> None:
    sync, async_ = Config.with_sync_save(), Config.with_async_save()
    assert type(sync.save) is SyncCheckpointSaverConfig
    assert type(async_.save) is AsyncCheckpointSaverConfig
    for f in dataclasses.fields(Config):
        if f.name != "save":
            assert getattr(sync, f.name) == getattr(Config(), f.name), f.name
            assert getattr(async_, f.name) == getattr(Config(), f.name), f.name


def test_build_returns_a_manager_with_that_config(tmp_path: Path) -> None:
    config = Config.with_sync_save()
    manager = config.build()
    try:
        assert isinstance(manager, CheckpointManager)
        assert manager.config is config
        assert manager.save(str(tmp_path / "c"), {"x": torch.ones(2)}) is None
        assert torch.equal(manager.load(str(tmp_path / "c"), into={"x": None})["x"], torch.ones(2))
    finally:
        manager.close()


def test_unsupported_saver_config_type_is_refused() -> None:
    with pytest.raises(TypeError, match="Unsupported saver_config type: CheckpointSaverConfig"):
        CheckpointManager(Config(save=CheckpointSaverConfig()))


def test_negative_wait_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="wait_timeout_secs"):
        SyncCheckpointSaverConfig(wait_timeout_secs=-1)


def test_items_must_hold_item_specs() -> None:
    with pytest.raises(TypeError, match="model"):
        CheckpointManager(Config(items={"model": object()}, save=SyncCheckpointSaverConfig()))  # type: ignore[dict-item]


def test_default_storage_is_local_filesystem_with_direct_io(tmp_path: Path) -> None:
    assert Config.with_sync_save().storage_config is None  # None: the local filesystem (docs/storage.md)
    assert LocalFileSystemStorageConfig().use_direct_io is True
    with CheckpointManager(Config.with_sync_save()) as manager:
        manager.save(str(tmp_path / "c"), {"model": {"w": torch.arange(4.0)}})
    assert (tmp_path / "c" / "model_0.pt").is_file() and (tmp_path / "c" / "manifest.json").is_file()


def test_sync_save_returns_none_and_is_durable_on_return(sync_manager: CheckpointManager, tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    assert sync_manager.save(str(target), {"model": {"w": torch.arange(4.0)}, "step": 3}) is None
    assert (target / "model_0.pt").is_file()
    assert (target / "step_0.pt").is_file()
    assert (target / "manifest.json").is_file()


def test_load_returns_a_new_mapping(sync_manager: CheckpointManager, tmp_path: Path) -> None:
    sync_manager.save(str(tmp_path / "c"), {"step": 7, "model": {"w": torch.ones(3)}})
    into = {"step": 0, "model": {"w": torch.zeros(3)}}
    out = sync_manager.load(str(tmp_path / "c"), into=into)
    assert out == {"step": 7, "model": into["model"]}
    assert out is not into
    assert into["step"] == 0  # a top-level scalar is returned, not written into `into`
    assert torch.equal(into["model"]["w"], torch.ones(3))


def test_storage_config_is_used(make_sync: ManagerFactory, tmp_path: Path) -> None:
    config = MemoryStorageConfig()
    manager = make_sync(storage_config=config)
    manager.save(str(tmp_path / "c"), {"a": 1})
    assert not (tmp_path / "c").exists()
    assert str(tmp_path / "c" / "a_0.pt") in config.store.files
    assert manager.load(str(tmp_path / "c"), into={"a": None}) == {"a": 1}


@pytest.mark.parametrize("use_mmap", [False, True])
def test_load_config_is_used(make_sync: ManagerFactory, tmp_path: Path, use_mmap: bool) -> None:
    """use_mmap=True: the loaded tensor lies in a mapping, of a copy of the file in memory (API_SURFACE: "streamed
    into one anonymous mmap"), never of the checkpoint's file itself (a write into that file would change it);
    use_mmap=False reads the item's bytes: the tensor lies in no file mapping at all."""
    manager = make_sync(load=CheckpointLoaderConfig(use_mmap=use_mmap, weights_only=False))
    manager.save(str(tmp_path / "c"), {"s": {1, 2}, "w": torch.ones(100_000)})
    out = manager.load(str(tmp_path / "c"), into={"s": None, "w": None})
    assert out["s"] == {1, 2} and torch.equal(out["w"], torch.ones(100_000))
    item_file = str(tmp_path / "c" / "w_0.pt")
    regions = memory_maps()
    assert not [region for region in regions if region.path == item_file]
    pointer = out["w"].untyped_storage().data_ptr()
    holding = [region for region in regions if region.start <= pointer < region.end]
    assert len(holding) == 1
    assert holding[0].path.startswith("/memfd:") is use_mmap, holding[0]


def test_sync_lock_is_a_usable_context_manager(sync_manager: CheckpointManager) -> None:
    lock = sync_manager.lock()
    assert isinstance(lock, contextlib.AbstractContextManager)
    with lock:
        pass


def test_sync_prewarm_is_a_noop(sync_manager: CheckpointManager, tmp_path: Path) -> None:
    assert sync_manager.prewarm_staging({"model": torch.ones(2)}) is None
    assert list(tmp_path.iterdir()) == []


def test_load_of_missing_checkpoint_names_it(sync_manager: CheckpointManager, tmp_path: Path) -> None:
    missing = tmp_path / "never-saved"
    with pytest.raises(FileNotFoundError, match="never-saved"):
        sync_manager.load(str(missing), into={"model": None})


def test_load_without_into_and_without_items_is_self_describing(
    sync_manager: CheckpointManager, tmp_path: Path
) -> None:
    # Issue 13: with no into= and no Config.items, every item comes back as the manifest describes it.
    sync_manager.save(str(tmp_path / "c"), {"a": 1})
    assert dict(sync_manager.load(str(tmp_path / "c"))) == {"a": 1}


@pytest.mark.parametrize(
    "call",
    [
        lambda m, p: m.save(p, {"a": 1}),
        lambda m, p: m.load(p, into={"a": None}),
        lambda m, p: m.prewarm_staging({"a": torch.ones(1)}),
        lambda m, p: m.lock().__enter__(),
    ],
    ids=["save", "load", "prewarm_staging", "lock"],
)
def test_closed_manager_refuses_every_call(
    make_sync: ManagerFactory, tmp_path: Path, call: Callable[[CheckpointManager, str], Any]
) -> None:
    manager = make_sync()
    manager.save(str(tmp_path / "c"), {"a": 1})
    manager.close()
    with pytest.raises(RuntimeError, match="closed CheckpointManager"):
        call(manager, str(tmp_path / "c"))


def test_close_is_idempotent(make_sync: ManagerFactory) -> None:
    manager = make_sync()
    manager.close()
    manager.close()


def test_manager_is_a_context_manager(tmp_path: Path) -> None:
    with CheckpointManager(Config.with_sync_save()) as manager:
        manager.save(str(tmp_path / "c"), {"a": 1})
    with pytest.raises(RuntimeError, match="closed"):
        manager.save(str(tmp_path / "d"), {"a": 1})


def test_async_save_returns_the_write_future(async_manager: CheckpointManager, tmp_path: Path) -> None:
    fut = async_manager.save(str(tmp_path / "c"), {"model": {"w": torch.ones(3)}})
    assert isinstance(fut, Future)
    assert fut.result(timeout=120) is None
    out = async_manager.load(str(tmp_path / "c"), into={"model": {"w": torch.zeros(3)}})
    assert torch.equal(out["model"]["w"], torch.ones(3))


def test_manager_without_config_is_async_with_defaults(tmp_path: Path) -> None:
    manager = CheckpointManager()
    try:
        assert type(manager.config.save) is AsyncCheckpointSaverConfig
        fut = manager.save(str(tmp_path / "c"), {"step": 1, "w": torch.arange(5)})
        assert isinstance(fut, Future)
        fut.result(timeout=120)
        assert manager.load(str(tmp_path / "c"), into={"step": None})["step"] == 1
    finally:
        manager.close()


def _module_level_callback(checkpoint_id: str, logger: Any) -> None:
    """Importable: pickles by reference for the writer process."""


@pytest.mark.parametrize("field", ["pre_finalize_callback", "finalize_callback"])
def test_an_async_managers_callback_that_cannot_pickle_is_refused_naming_the_field(field: str, tmp_path: Path) -> None:
    """API_SURFACE §9.2: "In async mode all of this (callbacks, barrier) runs inside the writer subprocess, so
    callbacks must pickle." A lambda got as far as the write, whose Future then failed with a bare "The checkpoint
    write request cannot be pickled for the async writer process.", naming neither the callback nor the fix. It is
    refused where it is set: at construction, and at the next call when the (live) field is changed later."""
    with pytest.raises(ConfigTypeError, match=rf"Config\.{field} cannot be pickled.*module level.*with_sync_save"):
        CheckpointManager(Config(save=AsyncCheckpointSaverConfig(), **{field: lambda checkpoint_id, logger: None}))
    config = Config(save=AsyncCheckpointSaverConfig(), storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    with CheckpointManager(config) as manager:
        setattr(config, field, _module_level_callback)
        manager.save(str(tmp_path / "ok"), {"a": 1}).result(timeout=120)  # an importable function is fine
        setattr(config, field, lambda checkpoint_id, logger: None)
        with pytest.raises(ConfigTypeError, match=rf"Config\.{field} cannot be pickled"):
            manager.save(str(tmp_path / "lambda"), {"a": 1})
        assert not (tmp_path / "lambda").exists()
        setattr(config, field, None)
    sync = Config(save=SyncCheckpointSaverConfig(), storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    setattr(sync, field, lambda checkpoint_id, logger: None)  # a sync save runs it in this process: no pickling
    with CheckpointManager(sync) as manager:
        manager.save(str(tmp_path / "sync"), {"a": 1})
