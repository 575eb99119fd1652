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


def test_the_check_never_pickles_the_callers_objects(tmp_path: Path, manager: CheckpointManager) -> None:
    """Only the engine's own write pickles a value (the async-race simulator's probe saw an extra read inside
    save() when the check pickled values); a class with its own __reduce__ is not judged at all (a stated
    limit: this one pickles as builtins.str, which the safe loader refuses, and no warning is said)."""
    CountsItsPickling.calls = 0
    assert _save(manager, tmp_path / "ck", {"extra": {"v": CountsItsPickling()}}) == []
    assert CountsItsPickling.calls == 1
    with torch.serialization.safe_globals([str]):  # its reduce names builtins.str, which the safe loader refuses
        assert manager.load(str(tmp_path / "ck"))["extra"]["v"] == "counted"
