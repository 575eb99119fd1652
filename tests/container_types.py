"""Container types that the traversal tests and the container-rule tests both walk, saved and loaded.

They live in one module so that a checkpoint pickled by one test file names the same classes as the other's,
and so that "a Mapping that is not a dict" means one thing in both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple


class Pair(NamedTuple):
    first: Any
    second: Any


class Frozen(Mapping[Any, Any]):
    """An immutable Mapping built from its items, as `dict(items)` is."""

    def __init__(self, items: Any = ()) -> None:
        self._items = dict(items)

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class KeywordMap(Frozen):
    """An immutable Mapping that cannot be built from its items (keywords only): a rebuild returns a dict."""

    def __init__(self, **items: Any) -> None:
        super().__init__(items)
