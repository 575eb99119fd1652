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
ADAPTER_ENV = "CONFORMANCE_BACKEND_ADAPTER"
DEFAULT_BACKEND = "torch_checkpointing"
PREFER_INSTALLED_ENV = "CONFORMANCE_PREFER_INSTALLED"

# Every name an adapter supplied in this process, in order ("sub.attr"). Tests and rank
# programs read slices of it to mark the clauses whose result depended on the adapter.
ADAPTED: list[str] = []


class MissingName(ImportError):
    """A name the design document gives is absent from the backend (and from its adapter, if any).

    The suite reports the clauses that needed it as *not measured* rather than failed,
    except the import-location clauses, which look names up with :func:`located` and fail.
    """

    def __init__(self, qualified: str, cause: BaseException) -> None:
        super().__init__(f"needs {qualified} ({type(cause).__name__}: {cause})")
        self.qualified = qualified


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
    os.environ["PYTHONPATH"] = os.pathsep.join([*kept, root])


def backend_name() -> str:
    """The module name of the backend; an environment variable so that rank and
    writer subprocesses resolve the same backend as the pytest process."""
    return os.environ.get(BACKEND_ENV, "").strip() or DEFAULT_BACKEND


def module(sub: str = "") -> ModuleType:
    """Import ``<backend>`` or ``<backend>.<sub>``."""
    name = backend_name() + (f".{sub}" if sub else "")
    return importlib.import_module(name)


def located(sub: str, attr: str) -> Any:
    """Fetch ``attr`` from ``<backend>.<sub>`` exactly where the document puts it: no adapter.

    The import-location clauses use this, so an adapter never makes them pass.
    """
    return getattr(module(sub), attr)


def adapter_name() -> str:
    """The adapter module (``--backend-adapter`` / ``CONFORMANCE_BACKEND_ADAPTER``), or ''."""
    return os.environ.get(ADAPTER_ENV, "").strip()


def _qualified(sub: str, attr: str) -> str:
    return f"{sub}.{attr}" if sub else attr


def _from_adapter(sub: str, attr: str) -> Any:
    """The adapter's value for ``sub.attr``: its ``NAMES`` mapping first, then a module attribute ``attr``."""
    mod = importlib.import_module(adapter_name())
    names = getattr(mod, "NAMES", {})
    key = _qualified(sub, attr)
    if key in names:
        return names[key]
    return getattr(mod, attr)


def name(sub: str, attr: str) -> Any:
    """Fetch ``attr`` from ``<backend>.<sub>`` (``sub`` may be empty for the top level).

    If the backend lacks it and an adapter is configured, the adapter's name is used and
    recorded in ``ADAPTED``. If neither has it, :class:`MissingName` is raised, so the
    clauses that needed it are reported as not measured instead of failed.
    """
    try:
        return located(sub, attr)
    except (ImportError, AttributeError) as exc:
        if not adapter_name():
            raise MissingName(_qualified(sub, attr), exc) from exc
        try:
            value = _from_adapter(sub, attr)
        except AttributeError:
            raise MissingName(_qualified(sub, attr), exc) from exc
        ADAPTED.append(_qualified(sub, attr))
        return value


def describe() -> str:
    """One line for pytest's report header: module path and version."""
    root = module()
    version = getattr(root, "__version__", "unknown")
    adapter = f", adapter {adapter_name()}" if adapter_name() else ""
    return f"conformance backend: {root.__name__} {version} ({getattr(root, '__file__', '?')}){adapter}"
