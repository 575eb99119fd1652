"""Multi-rank save defects found in round 15, on real gloo ranks (one 2-rank launch for every check).

* A DTensor sharded over the ranks, saved under a layout without `{rank}` and no resharder: only rank 0's
  shard was written (one file, lowest rank writes), and a load on the same ranks gave rank 1 rank 0's shard,
  with no error even with strict=True.
* A resharder declared on one rank only: the save committed without rank 1's sharding metadata (rank 1 only),
  or failed with a bare TypeError naming nothing (rank 0 only).
* Ranks saving one tensor with different global shapes (`DTensor.from_local(run_check=False)` with other
  local shapes): the save committed and replaced the checkpoint at the id; every resharding load then called
  it damaged.

Each must be refused on every rank before anything is written, leaving the earlier checkpoint whole.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank


def _manager(items: dict[str, ItemSpec]) -> CheckpointManager:
    config = CheckpointManager.Config.with_sync_save()
    config.items = items
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(config)


def _attempt(manager: CheckpointManager, path: str, state: dict[str, Any]) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager.save(path, state)
    except (CheckpointError, ValueError, RuntimeError) as exc:
        return f"refused: {exc}"
    return "saved"


def _earlier_whole(manager: CheckpointManager, path: str, expected: torch.Tensor) -> bool:
    loaded = manager.load(path, into={"model": None})["model"]["w"]
    return bool(torch.equal(torch.as_tensor(loaded.to_local() if hasattr(loaded, "to_local") else loaded), expected))


class RaisingOnRank1(DTensorResharder):
    """A custom resharder that fails on rank 1 only, after the check phase (in its own load)."""

    def load(self, *args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == 1:
            raise RuntimeError("custom resharder failed on rank 1")
        return super().load(*args, **kwargs)


def save_rank(root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(12.0).reshape(6, 2)
    shared = {"model": ItemSpec(layout=LayoutInfo("model.pt", TorchSerialization()))}
    out: dict[str, Any] = {}
    with _manager(shared) as manager:
        manager.save(f"{root}/sharded", {"model": {"w": torch.full((2,), 7.0)}})  # the earlier checkpoint
        sharded = DTensor.from_local(full[rank * 3 : rank * 3 + 3].clone(), mesh, [Shard(0)])
        out["sharded"] = _attempt(manager, f"{root}/sharded", {"model": {"w": sharded}})
        out["sharded_earlier_whole"] = _earlier_whole(manager, f"{root}/sharded", torch.full((2,), 7.0))
        replicated = DTensor.from_local(full.clone(), mesh, [Replicate()])
        out["replicated"] = _attempt(manager, f"{root}/replicated", {"model": {"w": replicated}})
    resharded = ItemSpec(resharder=DTensorResharder())
    with _manager({"model": resharded} if rank == 1 else {}) as manager:
        out["one_resharder"] = _attempt(manager, f"{root}/one", {"model": {"w": torch.ones(2)}})
    with _manager({"model": resharded}) as manager:
        manager.save(f"{root}/shapes", {"model": {"w": DTensor.from_local(torch.ones(3, 2), mesh, [Shard(0)])}})
        local = torch.ones(3 if rank == 0 else 2, 2)  # the ranks' local shapes disagree; run_check=False hides it
        uneven = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        out["shapes"] = _attempt(manager, f"{root}/shapes", {"model": {"w": uneven}})
        loaded = manager.load(
            f"{root}/shapes", into={"model": {"w": DTensor.from_local(torch.zeros(3, 2), mesh, [Shard(0)])}}
        )
        out["shapes_earlier_whole"] = bool(torch.equal(loaded["model"]["w"].to_local(), torch.ones(3, 2)))
    with _manager({"model": ItemSpec(resharder=RaisingOnRank1())}) as manager:
        template = torch.zeros(4)
        try:
            manager.load(f"{root}/one_process", into={"model": {"w": template}})
            out["custom"] = "loaded"
        except (CheckpointError, RuntimeError) as exc:
            out["custom"] = f"refused: {exc}"
        out["custom_filled"] = bool(torch.equal(template, torch.arange(4.0)))
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("round15")
    with _manager({"model": ItemSpec(resharder=DTensorResharder())}) as manager, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a plain tensor under a resharder is recorded as replicated: said so
        manager.save(f"{root}/one_process", {"model": {"w": torch.arange(4.0)}})  # world size 1: resharded later
    return launch(save_rank, 2, args=(str(root),), timeout=240)


def test_a_sharded_dtensor_under_a_layout_without_rank_is_refused_on_every_rank(
    outcomes: list[dict[str, Any]],
) -> None:
    for rank, out in enumerate(outcomes):
        assert out["sharded"].startswith("refused") and "{rank}" in out["sharded"], (rank, out["sharded"])
        assert out["sharded_earlier_whole"], rank


def test_a_replicated_dtensor_under_a_layout_without_rank_is_still_saved(outcomes: list[dict[str, Any]]) -> None:
    assert [out["replicated"] for out in outcomes] == ["saved", "saved"]


def test_a_resharder_declared_on_one_rank_only_is_refused_on_every_rank(outcomes: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(outcomes):
        assert out["one_resharder"].startswith("refused") and "resharder" in out["one_resharder"], (rank, out)


def test_ranks_saving_one_tensor_of_different_global_shapes_are_refused_on_every_rank(
    outcomes: list[dict[str, Any]],
) -> None:
    for rank, out in enumerate(outcomes):
        assert out["shapes"].startswith("refused") and "global shape" in out["shapes"], (rank, out["shapes"])
        assert out["shapes_earlier_whole"], rank


def test_a_custom_resharder_failing_on_one_rank_leaves_every_rank_s_template_as_it_was(
    outcomes: list[dict[str, Any]],
) -> None:
    """Round 15: rank 0 had filled its template, and said so. Round 24: every rank puts back what its own
    resharders wrote, so a failed load changed nothing on any rank, and says so."""
    assert outcomes[1]["custom"].startswith("refused") and "rank 1" in outcomes[1]["custom"], outcomes[1]
    rank0 = outcomes[0]
    assert rank0["custom"].startswith("refused") and "put its templates back" in rank0["custom"], rank0["custom"]
    assert not rank0["custom_filled"], rank0  # what the message says is so
