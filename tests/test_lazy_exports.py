"""The package's three name lists agree: what type checkers see, what is imported lazily, and `__all__`.

`torch_checkpointing/__init__.py` imports every top-level name on first use (PEP 562), so the names are written
down three times: under `TYPE_CHECKING` (for type checkers and IDEs, which cannot follow `__getattr__`), in the
lazy table `_EXPORTS` (module -> names) and in `__all__`. Nothing at run time ties the first to the others, so a
name added to one list only would type-check and fail at run time, or the reverse; this test ties them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch_checkpointing

_EAGER = {"Version", "__version__", "get_version"}  # imported at the top of the module, not lazily


def _type_checking_imports() -> dict[str, str]:
    """name -> defining module (relative to the package) of every import under `if TYPE_CHECKING:`."""
    tree = ast.parse(Path(torch_checkpointing.__file__).read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module is not None
                for alias in stmt.names:
                    found[alias.asname or alias.name] = stmt.module.removeprefix("torch_checkpointing.")
    return found


def test_type_checking_block_matches_the_lazy_table() -> None:
    seen = _type_checking_imports()
    lazy = torch_checkpointing._MODULE_OF
    assert seen == lazy, {
        "only under TYPE_CHECKING": sorted(set(seen) - set(lazy)),
        "only in _EXPORTS": sorted(set(lazy) - set(seen)),
        "different module": sorted(n for n in set(seen) & set(lazy) if seen[n] != lazy[n]),
    }


def test_all_names_are_lazy_or_eager() -> None:
    unknown = sorted(set(torch_checkpointing.__all__) - set(torch_checkpointing._MODULE_OF) - _EAGER)
    assert unknown == []
