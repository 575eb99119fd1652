"""A resharded item's non-tensor state comes back: an optimizer's param_groups, counters, names.

The design document reshards the optimizer with `DTensorResharder` and then calls
`optimizer.load_state_dict(restored["optimizer"])`. The resharder filled only tensors: every other leaf kept the
template's value, silently, even with `strict=True` (a fresh optimizer's learning rate instead of the one a
scheduler had reached, `step` counters back at 0). Non-tensor state is the same on every rank (it is not
sharded), so it is restored from one source rank's file, like a replicated tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import TemplateMismatchError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


@pytest.fixture
def manager() -> Iterator[CheckpointManager]:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.items = {"optimizer": ItemSpec(resharder=DTensorResharder())}
    m = CheckpointManager(config)
    yield m
    m.close()


def _optimizer_state(mesh: Any, placement: Any, fill: float, lr: float, step: int) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    def dt(value: float) -> Any:
        return distribute_tensor(torch.full((4, 2), value), mesh, [placement])

    return {
        "state": {0: {"step": torch.tensor(float(step)), "exp_avg": dt(fill), "exp_avg_sq": dt(fill * 2)}},
        "param_groups": [{"lr": lr, "betas": (0.9, 0.99), "weight_decay": 0.0, "params": [0], "name": "decay"}],
        "epoch": step,
    }


def _resharded_load(mesh: Any, manager: CheckpointManager, tmp_path: Path, **kw: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard

    manager.save(str(tmp_path / "ck"), {"optimizer": _optimizer_state(mesh, Shard(0), 1.5, lr=0.0125, step=40)})
    template = _optimizer_state(mesh, Replicate(), 0.0, lr=1.0, step=0)  # a fresh optimizer, another layout
    restored = manager.load(str(tmp_path / "ck"), into={"optimizer": template}, **kw)["optimizer"]
    assert restored["state"][0]["exp_avg"].full_tensor().eq(1.5).all()  # the tensors were resharded
    return restored


def test_non_tensor_state_of_a_resharded_item_is_restored(
    mesh: Any, manager: CheckpointManager, tmp_path: Path
) -> None:
    restored = _resharded_load(mesh, manager, tmp_path, strict=True)
    group = restored["param_groups"][0]
    assert group["lr"] == 0.0125 and group["betas"] == (0.9, 0.99) and group["name"] == "decay"
    assert restored["epoch"] == 40 and restored["state"][0]["step"].item() == 40.0


def test_the_template_objects_are_filled_in_place(mesh: Any, manager: CheckpointManager, tmp_path: Path) -> None:
    from torch.distributed.tensor import Replicate, Shard

    manager.save(str(tmp_path / "ck"), {"optimizer": _optimizer_state(mesh, Shard(0), 1.5, lr=0.0125, step=40)})
    template = _optimizer_state(mesh, Replicate(), 0.0, lr=1.0, step=0)
    groups = template["param_groups"]
    restored = manager.load(str(tmp_path / "ck"), into={"optimizer": template})["optimizer"]
    assert restored is template and restored["param_groups"] is groups and groups[0]["lr"] == 0.0125


def test_a_type_mismatch_in_non_tensor_state_refuses_before_any_copy(
    mesh: Any, manager: CheckpointManager, tmp_path: Path
) -> None:
    from torch.distributed.tensor import Replicate, Shard

    manager.save(str(tmp_path / "ck"), {"optimizer": _optimizer_state(mesh, Shard(0), 1.5, lr=0.0125, step=40)})
    template = _optimizer_state(mesh, Replicate(), 0.0, lr=1.0, step=0)
    template["param_groups"][0]["name"] = 3  # an int where the checkpoint holds a str
    with pytest.raises(TemplateMismatchError, match="param_groups"):
        manager.load(str(tmp_path / "ck"), into={"optimizer": template})
    assert template["state"][0]["exp_avg"].full_tensor().eq(0.0).all() and template["param_groups"][0]["lr"] == 1.0


def test_non_tensor_state_a_source_cannot_hold_is_reported(
    mesh: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """safetensors files hold tensors only: the template's other leaves are named as not restored."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    layout = LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization())
    config.items = {"model": ItemSpec(layout=layout, resharder=DTensorResharder())}
    manager = CheckpointManager(config)
    make: Callable[[Any, float], Any] = lambda p, v: distribute_tensor(torch.full((4,), v), mesh, [p])  # noqa: E731
    try:
        manager.save(str(tmp_path / "ck"), {"model": {"w": make(Shard(0), 2.0)}})
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            manager.load(str(tmp_path / "ck"), into={"model": {"w": make(Replicate(), 0.0), "note": "x"}})
        assert any("note" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        live = {"w": make(Replicate(), 0.0), "note": "x"}
        with pytest.raises(TemplateMismatchError, match="note"):
            manager.load(str(tmp_path / "ck"), into={"model": live}, strict=True)
        assert live["w"].full_tensor().eq(0.0).all()  # refused before the first copy
    finally:
        manager.close()
