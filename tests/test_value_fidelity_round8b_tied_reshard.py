"""Template tensors sharing memory on the resharding path: a load fills each from its own saved value, or
refuses before its first copy naming both entries (across items: `test_value_fidelity_round8b_tied_items.py`).

The refusals failed before the fix: the DTensor resharder made its block copies one after the other, so two
tied template entries the checkpoint holds different values for came back both holding the last one's values,
with no word said.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import TemplateMismatchError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig


def _manager(items: dict[str, ItemSpec]) -> CheckpointManager:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.items = items
    return CheckpointManager(config)


@pytest.fixture
def manager() -> Iterator[CheckpointManager]:
    m = _manager({"opt": ItemSpec(resharder=DTensorResharder())})
    yield m
    m.close()


def _sharded(mesh: Any, values: torch.Tensor) -> Any:
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(values, mesh, [Shard(0)])


def _replicated(mesh: Any, values: torch.Tensor) -> Any:
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(values, mesh, [Replicate()])


def _tied_dtensors(mesh: Any) -> dict[str, Any]:
    w = _replicated(mesh, torch.zeros(4))
    return {"a": w, "b": w}


def _overlapping_views(mesh: Any) -> dict[str, Any]:
    base = torch.zeros(6)
    return {"a": base[:4], "b": base[2:]}  # plain tensors: resharded as replicated ones


def _nested_view(mesh: Any) -> dict[str, Any]:
    base = torch.zeros(8)
    return {"a": base[2:6], "b": base.view(2, 4)[1]}


@pytest.mark.filterwarnings("ignore:Item 'opt' has plain")
@pytest.mark.parametrize("template", [_tied_dtensors, _overlapping_views, _nested_view], ids=lambda f: f.__name__)
def test_resharded_targets_sharing_memory_are_refused_when_the_saved_values_differ(
    mesh: Any, manager: CheckpointManager, template: Callable[[Any], dict[str, Any]], tmp_path: Path
) -> None:
    manager.save(
        str(tmp_path / "ck"),
        {"opt": {"a": _sharded(mesh, torch.arange(4.0)), "b": _sharded(mesh, torch.arange(4.0) + 10)}},
    )
    into = template(mesh)
    before = {k: _local(v).clone() for k, v in into.items()}
    with pytest.raises(TemplateMismatchError, match=r"opt::a and opt::b share memory"):
        manager.load(str(tmp_path / "ck"), into={"opt": into})
    assert all(torch.equal(_local(into[k]), before[k]) for k in into), "the refused load changed the template"


def test_tied_resharded_targets_fed_equal_saved_values_load(
    mesh: Any, manager: CheckpointManager, tmp_path: Path
) -> None:
    saved = _sharded(mesh, torch.arange(4.0) + 1)
    manager.save(str(tmp_path / "ck"), {"opt": {"a": saved, "b": saved}})  # tied at the save too
    into = _tied_dtensors(mesh)
    restored = manager.load(str(tmp_path / "ck"), into={"opt": into})["opt"]
    assert restored["a"] is restored["b"] and torch.equal(restored["a"].to_local(), torch.arange(4.0) + 1)


def test_untied_resharded_targets_still_load_each_its_own_value(
    mesh: Any, manager: CheckpointManager, tmp_path: Path
) -> None:
    manager.save(
        str(tmp_path / "ck"),
        {"opt": {"a": _sharded(mesh, torch.arange(4.0)), "b": _sharded(mesh, torch.arange(4.0) + 10)}},
    )
    into = {"a": _replicated(mesh, torch.zeros(4)), "b": _replicated(mesh, torch.zeros(4))}
    restored = manager.load(str(tmp_path / "ck"), into={"opt": into})["opt"]
    assert torch.equal(restored["a"].to_local(), torch.arange(4.0))
    assert torch.equal(restored["b"].to_local(), torch.arange(4.0) + 10)


def test_the_resharder_called_directly_refuses_too(mesh: Any, manager: CheckpointManager, tmp_path: Path) -> None:
    """The neighbour: `DTensorResharder.load_as_rank` (offline tools, tests) runs the same check."""
    manager.save(
        str(tmp_path / "ck"),
        {"opt": {"a": _sharded(mesh, torch.arange(4.0)), "b": _sharded(mesh, torch.arange(4.0) + 10)}},
    )
    metadata = _saved_metadata(tmp_path / "ck")
    into = _tied_dtensors(mesh)
    resharder = DTensorResharder()
    target = resharder.extract_sharding_metadata("opt", into)
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=False))
    with pytest.raises(TemplateMismatchError, match=r"opt::a and opt::b share memory"):
        resharder.load_as_rank(0, tmp_path / "ck", "opt", target, metadata, into, storage)
    assert torch.equal(into["a"].to_local(), torch.zeros(4))


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _saved_metadata(root: Path) -> Any:
    import json

    from torch_checkpointing.distributed_metadata import METADATA_FILE_NAME, DistributedMetadata

    raw = json.loads((root / METADATA_FILE_NAME).read_text())
    return DistributedMetadata.from_dict(raw).metadata["opt"]


# ------------------------------------------------------------------------------------ on two gloo ranks


def _two_rank_save(root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    with _manager({"opt": ItemSpec(resharder=DTensorResharder())}) as manager:
        state = {"a": _sharded(mesh, torch.arange(4.0)), "b": _sharded(mesh, torch.arange(4.0) + 10)}
        manager.save(root, {"opt": state})


def _two_rank_load(root: str, placement: str) -> dict[str, Any]:
    """Every rank refuses, on the resharding path (Replicate targets) and the direct one (the saved Shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    make = _replicated if placement == "replicate" else _sharded
    w = make(mesh, torch.zeros(4))
    before = w.to_local().clone()
    with _manager({"opt": ItemSpec(resharder=DTensorResharder())}) as manager:
        try:
            manager.load(root, into={"opt": {"a": w, "b": w}})
            said = ""
        except TemplateMismatchError as exc:
            said = str(exc)
    return {"said": said, "unchanged": bool(torch.equal(w.to_local(), before))}


PLACEMENTS = ("replicate", "shard")


def _two_rank_save_then_loads(root: str) -> dict[str, dict[str, Any]]:
    """One launch for every placement: the save, then each placement's load (its report under its name)."""
    _two_rank_save(root)
    return {placement: _two_rank_load(root, placement) for placement in PLACEMENTS}


@pytest.fixture(scope="module")
def two_rank_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    from simulator.launcher import launch

    root = tmp_path_factory.mktemp("tied_reshard") / "ck"
    return launch(_two_rank_save_then_loads, 2, args=(str(root),), timeout=120)


@pytest.mark.multirank
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_rank_refuses_tied_targets_fed_different_values(
    placement: str, two_rank_reports: list[dict[str, dict[str, Any]]]
) -> None:
    for rank, reports in enumerate(two_rank_reports):
        report = reports[placement]
        assert "opt::a and opt::b share memory" in report["said"], f"rank {rank}: {report}"
        assert report["unchanged"], f"rank {rank}: the refused load changed the template"
