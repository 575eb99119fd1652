"""Resolve the backend under test and give tests its public names.

The suite never imports ``torch_checkpointing`` by name: a backend may live under
another module name (``--backend MODULE`` or ``CONFORMANCE_BACKEND``). Every name
is looked up through the module paths the design document gives, relative to
the backend's root, so the import-location clauses are checked on any backend.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

BACKEND_ENV = "CONFORMANCE_BACKEND"
DEFAULT_BACKEND = "torch_checkpointing"


def backend_name() -> str:
    """The module name of the backend; an environment variable so that rank and
    writer subprocesses resolve the same backend as the pytest process."""
    return os.environ.get(BACKEND_ENV, "").strip() or DEFAULT_BACKEND


def module(sub: str = "") -> ModuleType:
    """Import ``<backend>`` or ``<backend>.<sub>``."""
    name = backend_name() + (f".{sub}" if sub else "")
    return importlib.import_module(name)


def name(sub: str, attr: str) -> Any:
    """Fetch ``attr`` from ``<backend>.<sub>`` (``sub`` may be empty for the top level)."""
    return getattr(module(sub), attr)


def describe() -> str:
    """One line for pytest's report header: module path and version."""
    root = module()
    version = getattr(root, "__version__", "unknown")
    return f"conformance backend: {root.__name__} {version} ({getattr(root, '__file__', '?')})"
