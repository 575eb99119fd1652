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


def save_twice_rank(first: str, second: str) -> None:
    """Two identical checkpoints in one launch, one for each test to damage."""
    save_rank(first)
    save_rank(second)


def load_damage_load_rank(root: str, key: str, damaged: str, needle: bytes) -> tuple[str, str]:
    """(report of a load of the whole checkpoint, report of a load once rank 0 flipped a bit of `damaged`)."""
    whole = load_rank(root, key)
    dist.barrier()
    if dist.get_rank() == 0:
        _flip(Path(root) / damaged, needle)
    dist.barrier()
    return whole, load_rank(root, key)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two checkpoints saved by 2 ranks: (for the shared-file test, for the resharded-source test)."""
    base = tmp_path_factory.mktemp("verified")
    roots = (str(base / "shared"), str(base / "model"))
    launch(save_twice_rank, 2, args=roots, timeout=120)
    return roots


def test_every_rank_refuses_a_damaged_shared_file(saved: tuple[str, str]) -> None:
    reports = launch(load_damage_load_rank, 2, args=(saved[0], "shared", "shared.json", b"12345"), timeout=120)
    assert [whole for whole, _ in reports] == ["ok", "ok"], reports
    damaged = [r for _, r in reports]
    assert all(r.startswith("CorruptCheckpointError") and "shared.json" in r for r in damaged), reports


def test_ranks_reading_a_damaged_source_refuse_the_resharded_load(saved: tuple[str, str]) -> None:
    # Saved rank 1 holds rows 6..11; of 3 loading ranks, ranks 1 (rows 4..7) and 2 (rows 8..11) read its file.
    needle = torch.arange(40, 44, dtype=torch.float32).numpy().tobytes()
    reports = launch(load_damage_load_rank, 3, args=(saved[1], "model", "model_1.pt", needle), timeout=120)
    assert [whole for whole, _ in reports] == ["ok", "ok", "ok"], reports
    damaged = [r for _, r in reports]
    # Rank 0 reads only model_0.pt, but the load is collective: it refuses too (tests/test_load_agreement_multirank.py).
    assert all(r.startswith("CorruptCheckpointError") and "model_1.pt" in r for r in damaged), reports
    assert "rank(s) [1, 2]" in damaged[0], reports
