"""The house plan's import rules, checked on the source (ARCHITECTURE: "which part may use which").

* Nothing in ``torch_checkpointing/`` imports ``simulator``, ``conformance``, ``tests`` or ``benchmarks``.
* ``simulator/``, ``conformance/``, ``benchmarks/`` and the examples in ``docs/examples/`` reach the backend only
  through the modules the API surface requires (its module map), and never through a private name, whether they
  import it, look it up by string (``backend.name("config", "X")``, ``located(...)``, ``backend_module(...)``)
  or reach it as an attribute (``manager._storage``, ``super()._get(...)`` in a subclass of a backend class).
* Operations (discovery, retention, the CLI, the HF export) sit on the public API and the manifest: they
  never import the writer, the writer process, the saver or the staging code.

The checks read the AST, so a violation is named by file and line; each checker is also run on a planted
violation, so a checker that stopped seeing anything fails here too.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "torch_checkpointing"

# The modules the API surface requires of every implementation ("Required in ours, with these names"),
# "" being the package top level.
PUBLIC_MODULES = frozenset(
    {
        "",
        "checkpoint_manager",
        "schema",
        "checkpoint_layout",
        "resharding",
        "dtensor_resharder",
        "default_resharder",
        "distributed_metadata",
        "dtensor_metadata",
        "types",
        "storage.base_storage",
        "storage.filesystem",
        "config",
        "staging",
        "barriers",
        "checkpoint_writer",
        "checkpoint_process",
    }
)
# The one underscore name the module map lists as public (`dtensor_metadata._PlacementSpec`).
LISTED_PRIVATE_NAMES = frozenset({"_PlacementSpec"})
LOOKUP_FUNCTIONS = frozenset({"name", "located", "module", "backend_module"})
# The parts that use the backend through its public API only (ARCHITECTURE: "public API of <backend>").
PUBLIC_API_USERS = ("simulator", "conformance", "benchmarks", "docs/examples")
# Private attributes these parts may reach: their own (`self._x`, `cls._x`) and the standard library's one
# way to die like a killed process, which a fault test needs (`os._exit`).
OWN_OBJECTS = frozenset({"self", "cls"})
ALLOWED_PRIVATE_ATTRIBUTES = frozenset({"os._exit"})
ENGINE_FORBIDDEN = frozenset({"simulator", "conformance", "tests", "benchmarks"})
OPERATIONS = ("discovery.py", "retention.py", "cli.py", "hf.py", "value_diff.py")
OPERATIONS_FORBIDDEN = frozenset({"checkpoint_writer", "checkpoint_process", "checkpoint_saver", "staging"})

Checker = Callable[[str, str], list[str]]


def _imported_modules(tree: ast.AST) -> Iterator[tuple[int, str, int, list[str]]]:
    """(line, module, relative level, imported names) for every import statement."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, 0, []
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or "", node.level, [alias.name for alias in node.names]


def engine_violations(source: str, where: str) -> list[str]:
    """Imports of the products stacked above the engine."""
    found = []
    for line, mod, level, _names in _imported_modules(ast.parse(source)):
        if level == 0 and mod.split(".")[0] in ENGINE_FORBIDDEN:
            found.append(f"{where}:{line}: the engine imports {mod}")
    return found


def _backend_sub(mod: str) -> str | None:
    """The backend-relative module of an absolute import, or None when it is not the backend."""
    if mod == PACKAGE:
        return ""
    if mod.startswith(PACKAGE + "."):
        return mod[len(PACKAGE) + 1 :]
    return None


def _public_name_problem(name: str) -> bool:
    return name.startswith("_") and name not in LISTED_PRIVATE_NAMES


def _import_violations(tree: ast.AST, where: str) -> Iterator[str]:
    for line, mod, level, names in _imported_modules(tree):
        sub = _backend_sub(mod) if level == 0 else None
        if sub is None:
            continue
        if sub not in PUBLIC_MODULES:
            yield f"{where}:{line}: imports {mod}, a module the API surface does not require"
        for name in names:
            if _public_name_problem(name):
                yield f"{where}:{line}: imports the private name {mod}.{name}"
            elif _is_backend_module(sub, name) and _joined(sub, name) not in PUBLIC_MODULES:
                yield f"{where}:{line}: imports {mod}.{name}, a module the API surface does not require"


def _joined(sub: str, name: str) -> str:
    return f"{sub}.{name}" if sub else name


def _is_backend_module(sub: str, name: str) -> bool:
    """Whether `from <backend>.<sub> import <name>` imports a module (`from torch_checkpointing import commit`)."""
    where = ROOT / PACKAGE / Path(*sub.split(".") if sub else ()) / name
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _called_name(node: ast.Call) -> str:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return ""


def _literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _lookup_violations(tree: ast.AST, where: str) -> Iterator[str]:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or _called_name(node) not in LOOKUP_FUNCTIONS or not node.args:
            continue
        sub = _literal(node.args[0])
        if sub is not None and sub not in PUBLIC_MODULES:
            yield f"{where}:{node.lineno}: looks up the backend module {sub!r}, which the API surface does not require"
        attr = _literal(node.args[1]) if len(node.args) > 1 else None
        if attr is not None and _public_name_problem(attr):
            yield f"{where}:{node.lineno}: looks up the private name {sub}.{attr}"


def _attributes_reached(tree: ast.AST) -> Iterator[tuple[int, ast.expr, str]]:
    """(line, owner, name) of every `owner.name` and `getattr(owner, "name", ...)`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.value, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            name = _literal(node.args[1]) if len(node.args) > 1 else None
            if name is not None:
                yield node.lineno, node.args[0], name


def _attribute_violations(tree: ast.AST, where: str) -> Iterator[str]:
    """`x._name` (or `getattr(x, "_name")`) on anything but the code's own objects: a manager's `_storage`, a
    backend class's private method overridden and called through `super()`. Private dunders (`__init__`) are the
    language's, not the backend's."""
    for line, node, name in _attributes_reached(tree):
        if not _public_name_problem(name) or name.startswith("__"):
            continue
        owner = ast.unparse(node)
        if owner not in OWN_OBJECTS and f"{owner}.{name}" not in ALLOWED_PRIVATE_ATTRIBUTES:
            yield f"{where}:{line}: reaches the private attribute {owner}.{name}"


def public_api_violations(source: str, where: str) -> list[str]:
    """Backend modules and names the simulator, the conformance suite, the benchmarks and the examples may not
    use."""
    tree = ast.parse(source)
    return [*_import_violations(tree, where), *_lookup_violations(tree, where), *_attribute_violations(tree, where)]


def operations_violations(source: str, where: str) -> list[str]:
    """Imports of the save machinery by an operations module (absolute or relative)."""
    found = []
    for line, mod, level, names in _imported_modules(ast.parse(source)):
        sub = _backend_sub(mod) if level == 0 else mod
        if sub is None:
            continue
        candidates = [sub] if sub else names  # `from . import staging`, `from torch_checkpointing import staging`
        for candidate in candidates:
            if candidate.split(".")[0] in OPERATIONS_FORBIDDEN:
                found.append(f"{where}:{line}: an operations module imports {candidate}")
    return found


def _sources(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _check(paths: list[Path], checker: Checker) -> list[str]:
    assert paths, "no source files found: the checker would pass on nothing"
    found: list[str] = []
    for path in paths:
        found += checker(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return found


def test_engine_imports_nothing_stacked_above_it() -> None:
    assert _check(_sources(PACKAGE), engine_violations) == []


@pytest.mark.parametrize("folder", PUBLIC_API_USERS)
def test_parts_above_the_engine_use_only_the_public_api(folder: str) -> None:
    assert _check(_sources(folder), public_api_violations) == []


def test_operations_never_reach_into_the_save_machinery() -> None:
    assert _check([ROOT / PACKAGE / name for name in OPERATIONS], operations_violations) == []


@pytest.mark.parametrize(
    ("checker", "source"),
    [
        (engine_violations, "def f():\n    from simulator.launcher import launch\n"),
        (engine_violations, "import tests.probes\n"),
        (public_api_violations, "from torch_checkpointing.read_context import ReadContext\n"),
        (public_api_violations, "from torch_checkpointing.config import _check\n"),
        (public_api_violations, "import torch_checkpointing.cold_read\n"),
        (public_api_violations, "x = backend.name('codecs', 'encode')\n"),
        (public_api_violations, "x = located('config', '_private')\n"),
        (public_api_violations, "m = backend_module('checkpoint_saver')\n"),
        (public_api_violations, "from torch_checkpointing.storage.fsspec_storage import FsspecStorage\n"),
        (public_api_violations, "n = manager._storage.fetched\n"),
        (public_api_violations, "class C(Base):\n    def _get(self, k):\n        return super()._get(k)\n"),
        (public_api_violations, "from torch_checkpointing import commit\n"),
        (public_api_violations, "from torch_checkpointing import CheckpointManager, read_context\n"),
        (public_api_violations, "n = getattr(manager, '_storage')\n"),
        (operations_violations, "from .staging import DefaultStager\n"),
        (operations_violations, "from . import checkpoint_writer\n"),
        (operations_violations, "from torch_checkpointing import staging\n"),
        (operations_violations, "from torch_checkpointing.checkpoint_process import CheckpointProcess\n"),
    ],
)
def test_each_checker_sees_a_planted_violation(checker: Checker, source: str) -> None:
    assert checker(source, "planted.py")


@pytest.mark.parametrize(
    ("checker", "source"),
    [
        (engine_violations, "import torch\nfrom .errors import CheckpointError\n"),
        (public_api_violations, "from torch_checkpointing.dtensor_metadata import _PlacementSpec\n"),
        (public_api_violations, "x = backend.name('', 'CheckpointManager')\n"),
        (public_api_violations, "self._n = 1\ncls._seen = set()\nos._exit(1)\nsuper().__init__()\n"),
        (public_api_violations, "from torch_checkpointing import CheckpointManager, checkpoint_layout\n"),
        (public_api_violations, "n = getattr(fn, '__name__', '?')\nm = getattr(self, '_seen')\n"),
        (operations_violations, "from .checkpoint_layout import LayoutInfo\nfrom . import manifest\n"),
    ],
)
def test_checkers_pass_what_the_plan_allows(checker: Checker, source: str) -> None:
    assert checker(source, "allowed.py") == []
