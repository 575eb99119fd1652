"""Issue 10 across real gloo ranks: every rank checks what it reads (shared files, resharded sources)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from simulator.launcher import launch
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank

ROWS = 12


def _manager(*keys: str) -> CheckpointManager:
    items = {
        "shared": ItemSpec(layout=LayoutInfo("shared.json", JsonSerialization())),
        "model": ItemSpec(resharder=DTensorResharder()),
    }
    return CheckpointManager(
        CheckpointManager.Config(
            items={k: v for k, v in items.items() if k in keys},
            save=CheckpointManager.Config.with_sync_save().save,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _model(zeros: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.zeros(ROWS, 4) if zeros else torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4)
    return {"w": distribute_tensor(full, mesh, [Shard(0)])}


def save_rank(root: str) -> None:
    manager = _manager("shared", "model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the {rank}-less layout's warning is meant
        manager.save(root, {"shared": {"n": 12345}, "model": _model(zeros=False)})
    manager.close()


def load_rank(root: str, key: str) -> str:
    """'ok', or the CheckpointError this rank raised (its type and message)."""
    manager = _manager(key)
    try:
        value: Any = None if key == "shared" else _model(zeros=True)
        manager.load(root, into={key: value})
        return "ok"
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        manager.close()


def _flip(path: Path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, f"{needle!r} is not in {path}: the damage would land elsewhere"
    data[at + 1] ^= 1
    path.write_bytes(bytes(data))


def test_every_rank_refuses_a_damaged_shared_file(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    launch(save_rank, 2, args=(root,), timeout=120)
    assert launch(load_rank, 2, args=(root, "shared"), timeout=120) == ["ok", "ok"]
    _flip(tmp_path / "ck" / "shared.json", b"12345")
    reports = launch(load_rank, 2, args=(root, "shared"), timeout=120)
    assert all(r.startswith("CorruptCheckpointError") and "shared.json" in r for r in reports), reports


def test_ranks_reading_a_damaged_source_refuse_the_resharded_load(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    launch(save_rank, 2, args=(root,), timeout=120)
    assert launch(load_rank, 3, args=(root, "model"), timeout=120) == ["ok", "ok", "ok"]
    # Saved rank 1 holds rows 6..11; of 3 loading ranks, ranks 1 (rows 4..7) and 2 (rows 8..11) read its file.
    _flip(tmp_path / "ck" / "model_1.pt", torch.arange(40, 44, dtype=torch.float32).numpy().tobytes())
    reports = launch(load_rank, 3, args=(root, "model"), timeout=120)
    # Rank 0 reads only model_0.pt, but the load is collective: it refuses too (tests/test_load_agreement_multirank.py).
    assert all(r.startswith("CorruptCheckpointError") and "model_1.pt" in r for r in reports), reports
    assert "rank(s) [1, 2]" in reports[0], reports
