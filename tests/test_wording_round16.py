"""Wording defects found in round 16, each with the test that failed before its fix.

* A JSON item whose value contains itself was refused as nested "more than 256 levels deep", naming a path
  that repeated the cycle 128 times; every other walk refuses a cycle with a `NestingError` naming the item
  and the path where the container is met again. Sync and async saves alike.
* Loading into a template holding a DTensor with a Partial placement was refused in words for a save
  ("... redistribute it ... before saving"); a load says a Partial DTensor cannot be a load target, and what
  to use instead, before anything is copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec, TemplateMismatchError
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.traversal import NestingError

# ------------------------------------------------------------------------------------ a JSON value's cycle


@dataclass
class Node:
    name: str
    links: list[Any] = field(default_factory=list)


def _self_dict() -> dict[str, Any]:
    d: dict[str, Any] = {}
    d["self"] = d
    return d


def _self_list() -> list[Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return loop


def _deep_loop() -> dict[str, Any]:
    d: dict[str, Any] = {"a": {"n": 1}}
    d["a"]["b"] = d
    return d


def _dataclass_loop() -> Node:
    node = Node("n")
    node.links.append(node)
    return node


CYCLES = [
    pytest.param(_self_dict, ("self",), "meta::self", id="dict-holds-itself"),
    pytest.param(_self_list, (1,), "meta::1", id="list-holds-itself"),
    pytest.param(_deep_loop, ("a", "b"), "meta::a.b", id="cycle-two-levels-down"),
    pytest.param(_dataclass_loop, ("links", 0), "meta::links.0", id="dataclass-holds-itself"),
]


@pytest.fixture(params=["sync", "async"])
def json_manager(request: pytest.FixtureRequest) -> Iterator[CheckpointManager]:
    save = SyncCheckpointSaverConfig() if request.param == "sync" else AsyncCheckpointSaverConfig()
    items = {"meta": ItemSpec(layout=LayoutInfo("meta.json", JsonSerialization()))}
    with CheckpointManager(CheckpointManager.Config(items=items, save=save)) as manager:
        yield manager


def _save(manager: CheckpointManager, path: Path, state: dict[str, Any]) -> None:
    future = manager.save(str(path), state)
    if future is not None:
        future.result(timeout=120)


@pytest.mark.parametrize(("make", "path", "where"), CYCLES)
def test_a_json_value_containing_itself_is_a_nesting_error_naming_item_and_path(
    json_manager: CheckpointManager, tmp_path: Path, make: Any, path: tuple[Any, ...], where: str
) -> None:
    """Defect: a cycle in a JSON item was a depth ValueError ("nested more than 256 levels deep") naming the
    cycle unrolled 128 times. Traversal's rule: a container that contains itself is a `NestingError` naming the
    path; the async save's refusal reaches the caller as the same type."""
    with pytest.raises(NestingError) as raised:
        _save(json_manager, tmp_path / "ck", {"meta": make()})
    error = raised.value
    assert error.cycle and error.key == "meta" and error.path == path
    assert f"'{where}' contains itself" in str(error)
    assert "256" not in str(error)
    assert not (tmp_path / "ck").exists()


def test_a_shared_json_subtree_is_not_a_cycle(json_manager: CheckpointManager, tmp_path: Path) -> None:
    """Traversal's rule: a container reached twice by different paths is walked twice, not refused."""
    shared = {"lr": 0.1, "steps": [1, 2]}
    value = {"a": shared, "b": [shared, {"again": shared}]}
    _save(json_manager, tmp_path / "ck", {"meta": value})
    assert json_manager.load(str(tmp_path / "ck"), into={"meta": None})["meta"] == value


def test_json_nesting_that_is_only_deep_still_names_the_depth(tmp_path: Path) -> None:
    """The depth refusal stays for a deep value without a cycle, no longer claiming it may contain itself."""
    deep: list[Any] = []
    for _ in range(300):
        deep = [deep]
    items = {"meta": ItemSpec(layout=LayoutInfo("meta.json", JsonSerialization()))}
    config = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig())
    with CheckpointManager(config) as manager, pytest.raises(ValueError, match="256 levels deep") as raised:
        manager.save(str(tmp_path / "ck"), {"meta": deep})
    assert not isinstance(raised.value, NestingError)


# ------------------------------------------------------------------------- a Partial DTensor as load target


def _resharding_manager() -> CheckpointManager:
    items = {"a": ItemSpec(), "model": ItemSpec(resharder=DTensorResharder())}
    return CheckpointManager(CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig()))


def test_loading_into_a_partial_dtensor_says_load_and_copies_nothing(mesh: Any, tmp_path: Path) -> None:
    """Defect: the refusal said "redistribute it ... before saving" on a load. A load says a Partial DTensor
    cannot be a load target, names the path and the placements to use, and is all-or-nothing: no item (the
    one before it included) and no other tensor of the item is overwritten."""
    from torch.distributed.tensor import DTensor, Partial

    with _resharding_manager() as manager:
        saved = {"a": torch.full((2,), 7.0), "model": {"b": torch.ones(2), "w": torch.arange(4.0)}}
        manager.save(str(tmp_path / "ck"), saved)
        a, b, local = torch.zeros(2), torch.zeros(2), torch.zeros(4)
        template = {"a": a, "model": {"b": b, "w": DTensor.from_local(local, mesh, [Partial()])}}
        with pytest.raises(TemplateMismatchError) as raised:
            manager.load(str(tmp_path / "ck"), into=template)
    message = str(raised.value)
    assert "model::w" in message and "cannot be a load target" in message
    assert "Replicate" in message and "Shard" in message and "redistribute(" in message
    assert "before saving" not in message and "being checkpointed" not in message, message
    assert not a.any() and not b.any() and not local.any()


def test_the_redistributed_template_the_refusal_suggests_loads(mesh: Any, tmp_path: Path) -> None:
    """The fix the refusal names works: `dt.redistribute(placements=[Replicate()])` is a load target."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    with _resharding_manager() as manager:
        manager.save(str(tmp_path / "ck"), {"a": torch.ones(1), "model": {"w": torch.arange(4.0)}})
        partial = DTensor.from_local(torch.zeros(4), mesh, [Partial()])
        target = partial.redistribute(placements=[Replicate()])
        out = manager.load(str(tmp_path / "ck"), into={"a": torch.zeros(1), "model": {"w": target}})
    assert torch.equal(out["model"]["w"].to_local(), torch.arange(4.0))


def test_saving_a_partial_dtensor_keeps_its_save_wording(mesh: Any, tmp_path: Path) -> None:
    """The save's refusal is unchanged: it still says to redistribute before saving."""
    from torch.distributed.tensor import DTensor, Partial

    with _resharding_manager() as manager, pytest.raises(RuntimeError, match=r"model::w.*before saving"):
        manager.save(
            str(tmp_path / "ck"),
            {"a": torch.ones(1), "model": {"w": DTensor.from_local(torch.ones(2), mesh, [Partial()])}},
        )
    assert not (tmp_path / "ck").exists()
