"""Round 19 across real gloo ranks: a damaged file of a custom resharder's item, read by one rank only, leaves
every template on every rank untouched (tests/test_load_all_or_nothing_round19.py has the one-rank cases)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.test_load_all_or_nothing_round19 import (
    SENTINEL,
    N,
    RangedSafetensorsResharder,
    WholeFileResharder,
    _value,
)
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank


class OwnRankWhole(WholeFileResharder):
    """Reads this rank's own file whole (the world size is unchanged)."""

    def source_rank(self) -> int:
        return dist.get_rank()


class OwnRankRanged(RangedSafetensorsResharder):
    """Reads this rank's own safetensors file tensor by tensor, copying each as it has it."""

    def source_rank(self) -> int:
        return dist.get_rank()


def _manager() -> CheckpointManager:
    items = {
        "first": ItemSpec(resharder=OwnRankWhole()),
        "model": ItemSpec(
            layout=LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization()), resharder=OwnRankRanged()
        ),
        "extra": ItemSpec(),
    }
    return CheckpointManager(
        CheckpointManager.Config(
            items=items,
            save=CheckpointManager.Config.with_sync_save().save,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _payload(rank: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        key: {"a": _value(1e6 * i + 1e5 * rank), "b": _value(1e6 * i + 1e5 * rank + 5e4)}
        for i, key in enumerate(["first", "model", "extra"])
    }


def save_rank(root: str) -> None:
    manager = _manager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # plain tensors recorded as replicated: meant
        manager.save(root, _payload(dist.get_rank()))
    manager.close()


def load_rank(root: str) -> tuple[str, list[str]]:
    """'ok' or the CheckpointError this rank raised, and the template entries the load changed."""
    manager = _manager()
    templates = {key: {"a": torch.full((N,), SENTINEL), "b": torch.full((N,), SENTINEL)} for key in _payload(0)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager.load(root, into=templates)
        outcome = "ok"
    except CheckpointError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        manager.close()
    if outcome == "ok":
        wrong = [
            f"{k}.{n}"
            for k, v in _payload(dist.get_rank()).items()
            for n, t in v.items()
            if not torch.equal(templates[k][n], t)
        ]
        return outcome, wrong
    changed = [
        f"{k}.{n}" for k, v in templates.items() for n, t in v.items() if not torch.equal(t, torch.full((N,), SENTINEL))
    ]
    return outcome, changed


def _damage(path: Path) -> None:
    """Flip one bit inside 'model.b' of saved rank 1, which only rank 1 of 2 loading ranks reads."""
    data = bytearray(path.read_bytes())
    at = data.find(_value(1e6 + 1e5 + 5e4)[N // 2 : N // 2 + 4].numpy().tobytes())
    assert at > 0
    data[at + 2] ^= 0x10
    path.write_bytes(bytes(data))


def save_load_damage_load_rank(root: str) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
    """One launch: save, load the whole checkpoint, rank 0 damages it, load again; (first load, second load)."""
    save_rank(root)
    whole = load_rank(root)
    dist.barrier()
    if dist.get_rank() == 0:
        _damage(Path(root) / "model_1.safetensors")
    dist.barrier()
    return whole, load_rank(root)


# Failed before round 19: rank 1's resharder met the damaged block after copying 'model.a' (and 'first'), and
# rank 0, whose own files were intact, had filled 'first' and 'model' before the ranks agreed on the failure.
def test_a_damaged_file_read_by_one_rank_changes_no_template_on_any_rank(tmp_path: Path) -> None:
    reports = launch(save_load_damage_load_rank, 2, args=(str(tmp_path / "ck"),), timeout=180)
    assert [whole for whole, _ in reports] == [("ok", []), ("ok", [])], reports
    for rank, (_, (outcome, changed)) in enumerate(reports):
        assert outcome != "ok", f"rank {rank} loaded a damaged checkpoint"
        assert "model_1.safetensors" in outcome, f"rank {rank}: {outcome}"
        assert changed == [], f"rank {rank}: the failed load changed {changed}"
