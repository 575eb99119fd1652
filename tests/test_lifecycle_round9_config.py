"""A `CheckpointManager.Config` changed after construction: checked again at the next call, never silently used.

The contract (the CheckpointManager docstring): `items`, `default` and the finalize callbacks are read at each
call and checked then; every other field built the saver, the writer process, the loader or the timeouts at
construction, so a change to it is refused by the next save()/load()/prewarm_staging() with a ConfigError
naming the field. Before, `wait_timeout_secs=-1`, a flipped staging mode, an async config replaced by a sync
one or a load flag set to a string were taken without a word (or half applied), and a non-ItemSpec placed in
`items` failed deep inside the item resolution with an AttributeError. The snapshot compared against copies
no user object: a storage config holding a lock (which cannot be deep-copied) still builds a manager.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, TorchSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.schema import ItemSpec
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

WAIT_S = 60


def _config(sync: bool) -> CheckpointManager.Config:
    config = CheckpointManager.Config.with_sync_save() if sync else CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = WAIT_S
    return config


@pytest.fixture(scope="module", params=[True, False], ids=["sync", "async"])
def manager(request: pytest.FixtureRequest) -> Iterator[CheckpointManager]:
    with CheckpointManager(_config(request.param)) as built:
        yield built


def _save(manager: CheckpointManager, checkpoint_id: Path) -> None:
    future = manager.save(str(checkpoint_id), {"w": torch.ones(4)})
    if future is not None:
        future.result(timeout=WAIT_S)


def _set_wait_timeout(config: CheckpointManager.Config) -> Callable[[], None]:
    old = config.save.wait_timeout_secs
    config.save.wait_timeout_secs = -1

    def undo() -> None:
        config.save.wait_timeout_secs = old

    return undo


def _replace_save(config: CheckpointManager.Config) -> Callable[[], None]:
    old = config.save
    config.save = SyncCheckpointSaverConfig() if not isinstance(old, SyncCheckpointSaverConfig) else _config(False).save

    def undo() -> None:
        config.save = old

    return undo


def _set_overwrite(config: CheckpointManager.Config) -> Callable[[], None]:
    config.save.overwrite = False

    def undo() -> None:
        config.save.overwrite = True

    return undo


def _set_load_flag(config: CheckpointManager.Config) -> Callable[[], None]:
    config.load.verify_checksums = "no"  # type: ignore[assignment]

    def undo() -> None:
        config.load.verify_checksums = None

    return undo


CHANGES: dict[str, tuple[Callable[[CheckpointManager.Config], Callable[[], None]], str]] = {
    "wait_timeout_secs=-1": (_set_wait_timeout, "save.wait_timeout_secs"),
    "save replaced by the other kind": (_replace_save, "save"),
    "overwrite flipped": (_set_overwrite, "save.overwrite"),
    "load flag set to a string": (_set_load_flag, "load.verify_checksums"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_construction_field_changed_afterwards_is_refused_by_the_next_call_naming_it(
    manager: CheckpointManager, tmp_path: Path, change: str
) -> None:
    make_change, named = CHANGES[change]
    undo = make_change(manager.config)
    try:
        with pytest.raises(ConfigError, match=rf"Config\.{named}\b.*changed after this manager was built") as save:
            _save(manager, tmp_path / "refused")
        assert "build a new CheckpointManager" in str(save.value)
        assert not (tmp_path / "refused").exists()
        with pytest.raises(ConfigError, match=rf"Config\.{named}\b"):
            manager.load(str(tmp_path / "refused"), into={"w": torch.zeros(4)})
    finally:
        undo()
    _save(manager, tmp_path / "after")  # set back: the manager works as before
    assert torch.equal(manager.load(str(tmp_path / "after"), into={"w": torch.zeros(4)})["w"], torch.ones(4))


def test_flipping_async_staging_after_construction_is_refused(tmp_path: Path) -> None:
    with CheckpointManager(_config(sync=False)) as manager:
        manager.config.save.staging_config.use_async_staging = True  # type: ignore[attr-defined]
        with pytest.raises(ConfigError, match=r"Config\.save\.staging_config\.use_async_staging"):
            _save(manager, tmp_path / "a")
        with pytest.raises(ConfigError, match=r"use_async_staging"):
            manager.prewarm_staging({"w": torch.ones(4)})


def test_a_non_itemspec_put_into_items_is_a_config_type_error_naming_the_key(
    manager: CheckpointManager, tmp_path: Path
) -> None:
    manager.config.items = {"w": "model_{rank}.pt"}  # type: ignore[dict-item]
    try:
        with pytest.raises(ConfigTypeError, match=r"Config\.items\['w'\] must be an ItemSpec"):
            _save(manager, tmp_path / "a")
        with pytest.raises(ConfigTypeError, match=r"Config\.items\['w'\] must be an ItemSpec"):
            manager.load(str(tmp_path / "a"), into={"w": torch.zeros(4)})
    finally:
        manager.config.items = {}


def test_items_changed_between_calls_apply_from_the_next_call(manager: CheckpointManager, tmp_path: Path) -> None:
    manager.config.items = {"meta": ItemSpec(layout=LayoutInfo("meta.json", JsonSerialization()))}
    try:
        future = manager.save(str(tmp_path / "a"), {"meta": {"step": 3}})
        if future is not None:
            future.result(timeout=WAIT_S)
        assert (tmp_path / "a" / "meta.json").is_file()
        assert manager.load(str(tmp_path / "a"))["meta"] == {"step": 3}
    finally:
        manager.config.items = {}


@dataclass
class LockedStorageConfig(LocalFileSystemStorageConfig):
    """A storage config holding an object deepcopy cannot copy (a client's lock): it must stay shared."""

    guard: Any = field(default_factory=threading.Lock)


def test_the_snapshot_copies_no_user_object(tmp_path: Path) -> None:
    config = _config(sync=True)
    config.storage_config = storage = LockedStorageConfig(use_direct_io=False)
    resharder_spec = ItemSpec(layout=LayoutInfo("w_{rank}.pt", TorchSerialization()))
    config.items = {"w": resharder_spec}
    with CheckpointManager(config) as manager:
        assert manager.config is config and manager.config.storage_config is storage
        assert manager.config.items["w"] is resharder_spec
        _save(manager, tmp_path / "a")
        storage.guard = threading.Lock()  # a user object replaced: compared by identity, so refused
        with pytest.raises(ConfigError, match=r"Config\.storage_config\.guard"):
            _save(manager, tmp_path / "b")
