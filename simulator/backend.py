"""The backend under test, reached only through the public module names of the design document.

The backend is picked by module name (``--backend``); ranks and the backend's own
spawned writer processes find it through the ``SIMULATOR_BACKEND`` environment
variable, so classes that must subclass backend types (storage, sharding
metadata, resharders) can be defined at import time and stay picklable.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

BACKEND_ENV = "SIMULATOR_BACKEND"
DEFAULT_BACKEND = "torch_checkpointing"


def backend_name() -> str:
    return os.environ.get(BACKEND_ENV, DEFAULT_BACKEND)


def backend_module(submodule: str = "") -> ModuleType:
    """Import `<backend>.<submodule>`; the error says which backend lacks which public module."""
    name = backend_name() + (f".{submodule}" if submodule else "")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"backend {backend_name()!r} has no public module {name!r} ({exc}); pass --backend MODULE "
            "naming a package that implements the design document's API"
        ) from exc


@dataclass(frozen=True)
class Backend:
    """The public names the scenarios use, resolved once per process."""

    top: ModuleType
    layout: ModuleType
    resharding: ModuleType
    dtensor_resharder: ModuleType
    distributed_metadata: ModuleType
    base_storage: ModuleType
    filesystem: ModuleType

    # The two classes are the backend's, picked at run time (`--backend`): no static type describes them (their
    # ``Config`` and fields are the design document's), so they are typed as what they are, unknown until imported.
    @property
    def CheckpointManager(self) -> Any:
        return self.top.CheckpointManager

    @property
    def ItemSpec(self) -> Any:
        return self.top.ItemSpec


def load_backend() -> Backend:
    return Backend(
        top=backend_module(),
        layout=backend_module("checkpoint_layout"),
        resharding=backend_module("resharding"),
        dtensor_resharder=backend_module("dtensor_resharder"),
        distributed_metadata=backend_module("distributed_metadata"),
        base_storage=backend_module("storage.base_storage"),
        filesystem=backend_module("storage.filesystem"),
    )
