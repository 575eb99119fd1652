"""Shared fixtures for the engine's single-rank tests.

Async managers spawn a writer process (seconds each), so the async fixtures are module-scoped: one manager
per test module that asks for it, reset between tests through its control files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from tests.memory_storage import Control, MemoryStorageConfig, controlled_manager, with_clean_controls
from tests.probes import gloo_world1
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

# The session's one moto server (`s3_server`), for every test that names it: registered here rather than imported
# into each module, which gave every importing module a server of its own and shadowed the name (ruff F811).
# `tests.process_state`: fails a test that leaves process-wide state (signals, rlimits, env, ...) changed behind it.
# `tests.dropped_managers`: fails a test that drops a CheckpointManager without close().
pytest_plugins = ["tests.s3_server", "tests.process_state", "tests.dropped_managers"]

ManagerFactory = Callable[..., CheckpointManager]


@pytest.fixture
def memory_config() -> MemoryStorageConfig:
    return MemoryStorageConfig()


@pytest.fixture
def make_sync() -> Iterator[ManagerFactory]:
    """Builds sync managers (keyword arguments go to Config) and closes them at teardown."""
    built: list[CheckpointManager] = []

    def make(**kwargs: Any) -> CheckpointManager:
        kwargs.setdefault("save", SyncCheckpointSaverConfig())
        manager = CheckpointManager(CheckpointManager.Config(**kwargs))
        built.append(manager)
        return manager

    yield make
    for manager in built:
        manager.close()


@pytest.fixture
def sync_manager(make_sync: ManagerFactory) -> CheckpointManager:
    return make_sync()


@pytest.fixture(scope="module")
def async_manager() -> Iterator[CheckpointManager]:
    """The async preset exactly as a user gets it: default storage (O_DIRECT on), default everything."""
    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    yield manager
    manager.close()


@pytest.fixture(scope="module")
def controlled_async(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CheckpointManager, Control]]:
    """An async manager whose storage logs every call and can be slowed or blocked through control files."""
    yield from controlled_manager(Control(tmp_path_factory.mktemp("control")))


@pytest.fixture
def control_async(controlled_async: tuple[CheckpointManager, Control]) -> Iterator[tuple[CheckpointManager, Control]]:
    """The module's controlled manager with clean controls before and after the test (and no write in flight)."""
    yield from with_clean_controls(*controlled_async)


@pytest.fixture
def dist_world1() -> Iterator[None]:
    """A one-rank gloo process group, for DTensors on a CPU DeviceMesh. Its store listens on a loopback port the
    kernel picks (port 0): a port probed free and bound later could be taken in between by another process."""
    if dist.is_initialized():
        yield
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    with gloo_world1(store):
        yield


@pytest.fixture
def mesh(dist_world1: None) -> Any:
    """A one-rank CPU DeviceMesh (on `dist_world1`'s process group), for DTensor state on one process."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))
