"""A save warns, once per type, when it writes a value that the default (safe) load of it will refuse.

Before, `save()` wrote an `argparse.Namespace` (or a dataclass, an Enum, a slice) into a torch file without a
word, and the default load of that checkpoint raised `RefusedPickleError`: found at resume time, on what may be
the only checkpoint left.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import RefusedPickleError

ABOUT = "which the default load of this checkpoint will refuse"


@dataclasses.dataclass
class TrainConfig:
    lr: float = 0.1


def _manager(kind: str, weights_only: bool = True) -> CheckpointManager:
    presets = {"async": CheckpointManager.Config.with_async_save, "sync": CheckpointManager.Config.with_sync_save}
    config = presets[kind]()
    config.load.weights_only = weights_only
    return CheckpointManager(config)


@pytest.fixture(params=["sync", "async"])
def manager(request: pytest.FixtureRequest) -> Iterator[CheckpointManager]:
    m = _manager(request.param)
    yield m
    m.close()


def _save(manager: CheckpointManager, path: Path, payload: dict[str, Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fut = manager.save(str(path), payload)
        if fut is not None:
            fut.result(timeout=120)
    return [str(w.message) for w in caught if ABOUT in str(w.message)]


def test_a_value_the_default_load_refuses_is_named_at_save(tmp_path: Path, manager: CheckpointManager) -> None:
    said = _save(manager, tmp_path / "ck", {"extra": {"args": argparse.Namespace(lr=1), "step": 3}})
    assert len(said) == 1
    assert "'extra::args'" in said[0] and "argparse.Namespace" in said[0] and "add_safe_globals" in said[0]
    with pytest.raises(RefusedPickleError):  # what the warning foretold
        manager.load(str(tmp_path / "ck"))


def test_the_warning_is_said_once_per_type(tmp_path: Path, manager: CheckpointManager) -> None:
    payload = {"extra": {"a": TrainConfig(), "b": [TrainConfig(), argparse.Namespace()]}}
    first = _save(manager, tmp_path / "s1", payload)
    again = _save(manager, tmp_path / "s2", payload)
    assert sorted("TrainConfig" in m for m in first) == [False, True] and again == []


def test_no_warning_where_the_default_load_reads_it_back(tmp_path: Path, manager: CheckpointManager) -> None:
    plain = {"model": {"w": torch.ones(3)}, "extra": {"n": 1, "s": "x", "d": torch.float32, "set": {1}, "c": 1j}}
    assert _save(manager, tmp_path / "plain", plain) == []
    with torch.serialization.safe_globals([TrainConfig]):  # allowed by the caller: the load will accept it
        assert _save(manager, tmp_path / "allowed", {"extra": {"cfg": TrainConfig()}}) == []
        assert manager.load(str(tmp_path / "allowed"))["extra"]["cfg"] == TrainConfig()


def test_no_warning_when_this_manager_loads_without_the_safe_unpickler(tmp_path: Path) -> None:
    m = _manager("sync", weights_only=False)
    try:
        assert _save(m, tmp_path / "ck", {"extra": {"args": argparse.Namespace(lr=1)}}) == []
        assert m.load(str(tmp_path / "ck"))["extra"]["args"].lr == 1
    finally:
        m.close()


class CountsItsPickling:
    """Pickles as a plain string, and counts how often it is pickled."""

    calls = 0

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        type(self).calls += 1
        return str, ("counted",)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_class_with_its_own_reduce_is_judged_by_what_it_pickles_as(tmp_path: Path, kind: str) -> None:
    """The check asks a class with its own __reduce__ what it pickles as (once per type per manager, so one
    extra reduce call beside the engine's own write): this one pickles as builtins.str, which the safe loader
    refuses, and a sync save used to say nothing before the default load raised RefusedPickleError.

    An async save sends the value to the writer process, which rebuilds it (here: a plain str) before it
    writes; the warning is then an overstatement, and the default load reads the value back."""
    CountsItsPickling.calls = 0
    manager = _manager(kind)
    try:
        said = _save(manager, tmp_path / "ck", {"extra": {"v": CountsItsPickling()}})
        assert len(said) == 1 and "builtins.str" in said[0] and "'extra::v'" in said[0]
        # The check, then the write; an async save's staging also looks once for tensors inside the value (it
        # shares the tree's memory, or torch.save writes it where a deep copy loses it), and copies it.
        per_save = 1 if kind == "sync" else 2
        assert CountsItsPickling.calls == 1 + per_save
        assert _save(manager, tmp_path / "again", {"extra": {"v": CountsItsPickling()}}) == []
        assert CountsItsPickling.calls == 1 + 2 * per_save  # the check ran once for the type
        if kind == "sync":
            with pytest.raises(RefusedPickleError):  # what the warning foretold
                manager.load(str(tmp_path / "ck"))
        else:
            assert manager.load(str(tmp_path / "ck"))["extra"]["v"] == "counted"
        with torch.serialization.safe_globals([str]):
            assert manager.load(str(tmp_path / "ck"))["extra"]["v"] == "counted"
    finally:
        manager.close()
