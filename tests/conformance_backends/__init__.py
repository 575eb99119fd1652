"""Backends for the conformance harness's own tests: our engine with one behaviour of its manager changed.

Each module here is a whole backend for ``pytest conformance --backend tests.conformance_backends.<name>``: it
answers the document's module paths (``<name>.config``, ``<name>.storage.filesystem``, ...) with the engine's
modules and changes only ``CheckpointManager.save`` or ``load``. They show that a durability clause is not
true by construction: a backend that never replaces, never saves or never loads a checkpoint is reported
*not measured* (or failed), not passed.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

ENGINE = "torch_checkpointing"
# The submodules the durability profile (and its helpers) look names up in.
SUBMODULES = ("config", "checkpoint_layout", "storage", "storage.base_storage", "storage.filesystem", "types")


def alias_engine_modules(backend: str) -> None:
    """Make ``<backend>.<sub>`` import as the engine's ``<sub>`` (import_module finds them in sys.modules)."""
    for sub in SUBMODULES:
        sys.modules[f"{backend}.{sub}"] = importlib.import_module(f"{ENGINE}.{sub}")


def engine_name(name: str) -> Any:
    """A top-level name of the engine (its top level is lazy, so look it up rather than copy it)."""
    return getattr(importlib.import_module(ENGINE), name)


def existing_id(checkpoint_id: str) -> bool:
    """Whether something is already at a local id (these backends are only run on the local filesystem)."""
    return Path(checkpoint_id).exists()
