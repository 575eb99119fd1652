"""Resolve the backend under test and give tests its public names.

The suite never imports ``torch_checkpointing`` by name: a backend may live under
another module name (``--backend MODULE`` or ``CONFORMANCE_BACKEND``). Every name
is looked up through the module paths the design document gives, relative to
the backend's root, so the import-location clauses are checked on any backend.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

BACKEND_ENV = "CONFORMANCE_BACKEND"
DEFAULT_BACKEND = "torch_checkpointing"
PREFER_INSTALLED_ENV = "CONFORMANCE_PREFER_INSTALLED"


def prefer_installed_requested() -> bool:
    return os.environ.get(PREFER_INSTALLED_ENV, "") not in ("", "0")


def prefer_installed_backend(repo_root: Path) -> None:
    """Move the checkout behind site-packages so an installed backend wins.

    Used when the suite runs against a published release from a checkout that also
    contains a package of the same name: ``conformance`` and ``simulator`` stay
    importable from the checkout (nothing else provides them), the backend resolves
    to the installed distribution. Child processes inherit the order (spawn copies
    ``sys.path``) and, through PYTHONPATH, so do plain subprocesses.
    """
    root = str(repo_root)
    hits = [p for p in sys.path if os.path.abspath(p or ".") == root]
    for p in hits:
        sys.path.remove(p)
    sys.path.append(root)
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != root]
    os.environ["PYTHONPATH"] = os.pathsep.join(kept + [root])


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
