"""A save warns for a container class the default (safe) load will refuse, as it does for a leaf.

Each test here that expects a warning failed before the fix: the save-time check judged only leaf types, so a
named tuple, a `defaultdict`, a torch `return_types` value or a dict subclass of the caller's saved with no
warning, and the default load of that checkpoint raised `RefusedPickleError`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from tests.test_safe_load_warning import _save
from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import RefusedPickleError


class Point(NamedTuple):
    x: Any
    y: Any


class Tagged(dict):  # type: ignore[type-arg]
    pass


def _max() -> Any:
    return torch.max(torch.arange(4.0).reshape(2, 2), 0)


REFUSED: list[tuple[Callable[[], Any], str]] = [
    (lambda: defaultdict(int, {"x": 1}), "collections.defaultdict"),
    (lambda: Point(torch.ones(1), 2), f"{__name__}.Point"),
    (_max, "torch.return_types.max"),
    (lambda: Tagged(w=torch.ones(1)), f"{__name__}.Tagged"),
]


@pytest.fixture(params=["sync", "async"])
def manager(request: pytest.FixtureRequest) -> Iterator[CheckpointManager]:
    presets = {"async": CheckpointManager.Config.with_async_save, "sync": CheckpointManager.Config.with_sync_save}
    m = CheckpointManager(presets[request.param]())
    yield m
    m.close()


@pytest.mark.parametrize(("make", "name"), REFUSED, ids=[n.rsplit(".", 1)[1] for _, n in REFUSED])
def test_a_container_class_the_default_load_refuses_is_named_at_save(
    make: Callable[[], Any], name: str, tmp_path: Path, manager: CheckpointManager
) -> None:
    said = _save(manager, tmp_path / "ck", {"extra": {"step": 3, "s": [1, {"c": make()}]}})
    assert len(said) == 1, said
    assert "'extra::s.1.c'" in said[0] and f"holds a {name}," in said[0] and "add_safe_globals" in said[0]
    with pytest.raises(RefusedPickleError):  # what the warning foretold
        manager.load(str(tmp_path / "ck"))


def test_a_refused_container_at_the_item_root_is_named_by_the_item(tmp_path: Path, manager: CheckpointManager) -> None:
    said = _save(manager, tmp_path / "ck", {"extra": Point(1, 2)})
    assert len(said) == 1 and "Item 'extra' holds" in said[0], said


def test_a_container_type_is_said_once_per_manager(tmp_path: Path, manager: CheckpointManager) -> None:
    payload = {"extra": {"a": Point(1, 2), "b": [Point(3, 4)]}, "more": {"c": Point(5, 6)}}
    first = _save(manager, tmp_path / "s1", payload)
    again = _save(manager, tmp_path / "s2", {"other": {"p": Point(0, 0)}})
    assert len(first) == 1 and again == [], (first, again)


def test_no_warning_for_containers_the_default_load_reads_back(tmp_path: Path, manager: CheckpointManager) -> None:
    value = {
        "o": OrderedDict(a=torch.ones(1)),
        "c": Counter(k=2),
        "size": torch.Size([2, 3]),
        "plain": [(1, 2), {"x": [torch.zeros(1)]}],
    }
    assert _save(manager, tmp_path / "ck", {"extra": value}) == []
    loaded = manager.load(str(tmp_path / "ck"))["extra"]
    assert type(loaded["o"]) is OrderedDict and loaded["c"] == Counter(k=2)


def test_no_warning_for_a_container_class_the_caller_allowed(tmp_path: Path, manager: CheckpointManager) -> None:
    with torch.serialization.safe_globals([Point]):
        assert _save(manager, tmp_path / "ck", {"extra": {"p": Point(1, 2)}}) == []
        assert manager.load(str(tmp_path / "ck"))["extra"]["p"] == Point(1, 2)
