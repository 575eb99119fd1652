"""A save is planned once: `SavePlan` is frozen and keyword-only, and the writer's request wraps it (the plan
without its items, whose values travel as entries) instead of copying its fields."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.checkpoint_saver import SavePlan as SaverSavePlan
from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig, SavePlan, WriteEntry, WriteRequest
from torch_checkpointing.schema import ItemSpec, resolve


def _plan(tmp_path: Path, **extra: object) -> SavePlan:
    items = tuple(resolve({"w": torch.ones(2)}, {}, ItemSpec(), 0))
    return SavePlan(
        checkpoint_dir=str(tmp_path / "c"), tmp_dir=str(tmp_path / ".c.tmp"), rank=0, world_size=1, items=items, **extra
    )


def test_save_plan_is_frozen_and_keyword_only(tmp_path: Path) -> None:
    plan = _plan(tmp_path, step=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.step = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        SavePlan(str(tmp_path / "c"), str(tmp_path / ".c.tmp"), 0, 1)  # type: ignore[misc]
    assert SaverSavePlan is SavePlan  # still importable from the saver, where it used to live


def test_write_request_wraps_the_plan_without_its_items(tmp_path: Path) -> None:
    plan = _plan(tmp_path, step=7, metrics={"loss": 0.5}, overwrite=False)
    entry = WriteEntry("w", "w_0.pt", TorchSerialization(), torch.ones(2))
    request = plan.request([entry], CheckpointWriterConfig(file_write_max_threads=2), trainer_pid=123)
    assert request.plan == dataclasses.replace(plan, items=())
    assert (request.entries, request.file_write_max_threads, request.trainer_pid) == ([entry], 2, 123)
    assert [f.name for f in dataclasses.fields(WriteRequest)] == [
        "plan",
        "entries",
        "file_write_max_threads",
        "trainer_pid",
    ]
    travelled = pickle.loads(pickle.dumps(request))  # it crosses to the writer process
    assert travelled.plan == request.plan and travelled.entries[0].key == "w"
