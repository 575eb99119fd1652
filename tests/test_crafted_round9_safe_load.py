"""The save-time safe-load warning judges what a value pickles as, not only its class.

A class with its own `__reduce__` pickles as whatever that returns: `argparse.Namespace`, a factory function
of the caller's module, `builtins.str`. The warning judged the class alone and skipped such classes, so the
save said nothing and the default (weights_only) load of the checkpoint raised `RefusedPickleError`, found at
resume time. Each test failed on the code before the fix, except those saying they pin what held.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_safe_load_warning import _manager, _save
from torch_checkpointing.errors import RefusedPickleError


def make_config(lr: float) -> dict[str, float]:
    """A module-level factory: what `ViaFactory` pickles as (a global the safe loader does not know)."""
    return {"lr": lr}


class ViaNamespace:
    """Pickles as an `argparse.Namespace`: the class itself never appears in the file."""

    def __reduce__(self) -> tuple[Any, ...]:
        return argparse.Namespace, (), {"lr": 0.1}


class ViaFactory:
    """Pickles as a call of `make_config`, which the safe loader refuses."""

    def __reduce__(self) -> tuple[Any, ...]:
        return make_config, (0.1,)


class ViaOrderedDict:
    """Pickles as a plain `collections.OrderedDict`, which the safe loader accepts: no warning."""

    def __reduce__(self) -> tuple[Any, ...]:
        return collections.OrderedDict, ((("lr", 0.1),),)


class WrapsNamespace:
    """Pickles as an `OrderedDict` (accepted) holding an `argparse.Namespace` (refused) among its arguments."""

    def __reduce__(self) -> tuple[Any, ...]:
        return collections.OrderedDict, ((("args", argparse.Namespace(lr=1)),),)


class NamespaceDict(dict[str, Any]):
    """A dict subclass (a container the walk descends into) whose own `__reduce__` names another global."""

    def __reduce__(self) -> tuple[Any, ...]:
        return make_config, (0.1,)


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


CASES = {
    "reduces to argparse.Namespace": (ViaNamespace, "argparse.Namespace"),
    "reduces to a factory function": (ViaFactory, f"{__name__}.make_config"),
    "reduces with a refused argument": (WrapsNamespace, "argparse.Namespace"),
    "container reducing to a factory": (NamespaceDict, f"{__name__}.make_config"),
}


# An async save hands the value to its writer process by pickle, which rebuilds it there: a factory's result
# (a plain dict) is what its file holds, so only a sync save writes the factory's global.
SYNC_ONLY = {"reduces to a factory function", "container reducing to a factory"}


@pytest.mark.parametrize(
    ("kind", "name"), [(k, n) for n in sorted(CASES) for k in ("sync", "async") if k == "sync" or n not in SYNC_ONLY]
)
def test_a_value_whose_reduce_the_default_load_refuses_is_named_at_save(tmp_path: Path, kind: str, name: str) -> None:
    cls, refused = CASES[name]
    m = _manager(kind)
    try:
        said = _save(m, tmp_path / "ck", {"extra": {"cfg": cls(), "step": 3}})
        assert len(said) == 1, said
        assert "'extra::cfg'" in said[0] and cls.__qualname__ in said[0] and refused in said[0], said[0]
        with pytest.raises(RefusedPickleError):  # what the warning foretold
            m.load(str(tmp_path / "ck"))
    finally:
        m.close()


def test_no_warning_where_the_reduced_value_loads_back(tmp_path: Path, kind: str) -> None:
    """Pins what held: a reduce to a global the safe loader accepts says nothing, and loads."""
    m = _manager(kind)
    try:
        assert _save(m, tmp_path / "ck", {"extra": {"cfg": ViaOrderedDict(), "w": torch.ones(2)}}) == []
        assert m.load(str(tmp_path / "ck"))["extra"]["cfg"] == collections.OrderedDict(lr=0.1)
    finally:
        m.close()


class CountsItsReduce:
    """Counts its `__reduce__` calls; pickles as an OrderedDict, which loads."""

    calls = 0

    def __reduce__(self) -> tuple[Any, ...]:
        type(self).calls += 1
        return collections.OrderedDict, ()


def test_the_check_asks_a_type_for_its_reduction_once_per_manager(tmp_path: Path) -> None:
    """The check costs one `__reduce__` call per type per manager (then cached), not one per value or save."""
    CountsItsReduce.calls = 0
    m = _manager("sync")
    try:
        for step in range(3):
            _save(m, tmp_path / f"ck{step}", {"extra": {"a": CountsItsReduce(), "b": [CountsItsReduce()]}})
    finally:
        m.close()
    pickled = 2 * 3  # the engine's own writes
    assert CountsItsReduce.calls == pickled + 1
