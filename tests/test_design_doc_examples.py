"""The design document's own examples, run on a single rank exactly as a user would write them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import DistributedItemMetadata, ShardingMetadata
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.resharding import Resharder
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.types import NestedPath


class MyCustomDataloaderResharder(Resharder):
    """The document's custom resharder, as a stub: no sharding metadata, nothing to reshard."""

    calls: ClassVar[list[str]] = []

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[NestedPath, ShardingMetadata]:
        MyCustomDataloaderResharder.calls.append(f"extract:{item_key}")
        return {}

    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: dict[NestedPath, ShardingMetadata],
        source_metadata: DistributedItemMetadata,
        target: Any,
        storage: Storage,
    ) -> list[NestedPath]:
        MyCustomDataloaderResharder.calls.append(f"load:{item_key}")
        return []


class Dataloader:
    def __init__(self) -> None:
        self.epoch, self.index = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.index = sd["epoch"], sd["index"]


def _train_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _config(preset: str) -> CheckpointManager.Config:
    config = CheckpointManager.Config(
        items={
            "model": ItemSpec(requires_copy=True, resharder=DTensorResharder()),
            "optimizer": ItemSpec(requires_copy=True, resharder=DTensorResharder()),
            "dataloader": ItemSpec(requires_copy=False, resharder=MyCustomDataloaderResharder()),
            "misc_state": ItemSpec(
                requires_copy=False, layout=LayoutInfo("misc_state_{rank}.json", JsonSerialization())
            ),
        },
    )
    if preset == "sync":
        config.save = SyncCheckpointSaverConfig()
    return config


@pytest.mark.parametrize("preset", ["async", "sync"])
def test_full_config_example_round_trip(tmp_path: Path, preset: str) -> None:
    MyCustomDataloaderResharder.calls.clear()
    checkpoint_id = str(tmp_path / "step_3")
    model, optimizer = _train_state(0)
    dataloader = Dataloader()
    dataloader.epoch, dataloader.index = 2, 17
    step = 3
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optim = optimizer.state_dict()
    saved_exp_avg = saved_optim["state"][0]["exp_avg"].clone()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DTensorResharder warns about plain tensors (replicated on one rank)
        manager = CheckpointManager(_config(preset))
        try:
            result = manager.save(
                checkpoint_id,
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "dataloader": dataloader.state_dict(),
                    "misc_state": {"step": step},
                },
            )
            if preset == "async":
                result.result(timeout=120)
            else:
                assert result is None

            files = sorted(p.name for p in Path(checkpoint_id).iterdir())
            assert {"model_0.pt", "optimizer_0.pt", "dataloader_0.pt", "misc_state_0.json"} <= set(files)
            assert json.loads((Path(checkpoint_id) / "misc_state_0.json").read_text()) == {"step": 3}

            new_model, new_optimizer = _train_state(1)
            new_dataloader = Dataloader()
            param = new_model[0].weight
            restored = manager.load(
                checkpoint_id,
                into={
                    "model": new_model.state_dict(),
                    "optimizer": new_optimizer.state_dict(),
                    "dataloader": new_dataloader.state_dict(),
                    "misc_state": {"step": 0},
                },
            )
            new_optimizer.load_state_dict(restored["optimizer"])
            new_dataloader.load_state_dict(restored["dataloader"])
            new_step = restored["misc_state"]["step"]
        finally:
            manager.close()

    # Tensors were copied in place: no load_state_dict() needed for the model.
    assert new_model[0].weight is param
    for k, v in new_model.state_dict().items():
        assert torch.equal(v, saved_params[k]), k
    assert torch.equal(new_optimizer.state_dict()["state"][0]["exp_avg"], saved_exp_avg)
    assert new_optimizer.state_dict()["param_groups"][0]["lr"] == 0.01
    assert (new_dataloader.epoch, new_dataloader.index) == (2, 17)
    assert new_step == 3
    # The custom resharder was wired in on both save and load without any metadata plumbing.
    assert MyCustomDataloaderResharder.calls.count("extract:dataloader") >= 2


def test_override_just_one_item_example(tmp_path: Path) -> None:
    manager = CheckpointManager(
        CheckpointManager.Config(items={"dataloader": ItemSpec(requires_copy=False)}, save=SyncCheckpointSaverConfig())
    )
    try:
        manager.save(str(tmp_path / "c"), {"dataloader": {"i": 1}, "model": {"w": torch.ones(2)}, "step": 1})
        out = manager.load(str(tmp_path / "c"), into={"dataloader": None, "model": None, "step": None})
    finally:
        manager.close()
    assert out["dataloader"] == {"i": 1} and out["step"] == 1 and torch.equal(out["model"]["w"], torch.ones(2))


def test_dtensor_resharder_snippet(tmp_path: Path) -> None:
    model, _ = _train_state(0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = CheckpointManager(
            CheckpointManager.Config(
                items={"model": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
            )
        )
        try:
            path = str(tmp_path / "c")
            manager.save(path, {"model": model.state_dict()})
            fresh, _ = _train_state(5)
            manager.load(path, into={"model": fresh.state_dict()})
            with pytest.raises(ValueError, match="live target"):
                manager.load(path, into={"model": None})
        finally:
            manager.close()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k])


def test_resharding_names_are_re_exported_at_top_level() -> None:
    import torch_checkpointing
    from torch_checkpointing import resharding

    for name in ("Resharder", "LoadPlan", "ReshardingInfo"):
        assert getattr(torch_checkpointing, name) is getattr(resharding, name)
