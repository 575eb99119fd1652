"""Round 17, on real gloo ranks (one launch): what a custom resharder reads is agreed on before any copy.

The check phase cannot know what a custom resharder's `load` will read, so it reads in the copy phase; a
damaged block there raised on that rank only after every other rank had restored its templates (and the
agreement then made those ranks raise too, their templates already changed). The test failed before the fix.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.test_verified_loads import WholeFileResharder
from tests.test_verified_loads_multirank import _flip
from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.schema import ItemSpec
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank


class OwnFileResharder(WholeFileResharder):
    """A custom resharder reading this rank's own file through the storage view it is given."""

    def load(
        self, source_path: Path, item_key: str, target_metadata: Any, source_metadata: Any, target: Any, storage: Any
    ) -> list[Any]:
        data = storage.read(source_metadata.get_file_path(dist.get_rank(), source_path, item_key))
        target["w"].copy_(torch.load(io.BytesIO(data), weights_only=True)["w"])
        return []


def _manager() -> CheckpointManager:
    config = CheckpointManager.Config(
        items={"model": ItemSpec(resharder=OwnFileResharder()), "aaa": ItemSpec()},
        save=CheckpointManager.Config.with_sync_save().save,
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
    )
    return CheckpointManager(config)


def _w() -> torch.Tensor:
    return torch.arange(1024, dtype=torch.float32) + 10_000 * dist.get_rank()


def scenarios(root: str) -> dict[str, Any]:
    rank, base = dist.get_rank(), Path(root)
    warnings.simplefilter("ignore")
    manager = _manager()
    out: dict[str, Any] = {}
    try:
        manager.save(str(base / "ck"), {"model": {"w": _w()}, "aaa": {"x": torch.full((3,), float(rank + 1))}})
        dist.barrier()
        if rank == 0:  # a block only rank 1's resharder reads
            _flip(base / "ck" / "model_1.pt", torch.arange(100, 104, dtype=torch.float32).add(10_000).numpy().tobytes())
        dist.barrier()
        a, w = torch.zeros(3), torch.zeros(1024)
        try:
            manager.load(str(base / "ck"), into={"model": {"w": w}, "aaa": {"x": a}})
            out["damaged"] = {"result": "ok"}
        except CheckpointError as exc:
            out["damaged"] = {"result": type(exc).__name__, "message": str(exc), "aaa_untouched": bool((a == 0).all())}
    finally:
        manager.close()
    return out


def test_a_custom_resharder_failing_on_one_rank_leaves_every_rank_s_other_templates_untouched(tmp_path: Path) -> None:
    reports = launch(scenarios, 2, args=(str(tmp_path),), timeout=240)
    for rank, report in enumerate(reports):
        damaged = report["damaged"]
        assert damaged["result"] == "CorruptCheckpointError", (rank, damaged)
        assert "model_1.pt" in damaged["message"], (rank, damaged)
        assert damaged["aaa_untouched"], (rank, "item 'aaa' was restored on this rank before the refusal")
