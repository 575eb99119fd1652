"""A JSON item declared with `JsonSerialization(cls=...)` whose stored value the class no longer rebuilds (a
field's type changed between versions of the code, a required field was added) is a `TemplateMismatchError`
naming the file, the field and the way out, raised before anything is copied into the other items' templates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec, TemplateMismatchError
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo


@dataclasses.dataclass
class SavedV1:
    n: float
    lr: float


@dataclasses.dataclass
class LoadedAsInt:
    n: int
    lr: float


@dataclasses.dataclass
class LoadedWithNewField:
    n: float
    lr: float
    warmup: int


def _manager(cls: type) -> CheckpointManager:
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.items = {"hparams": ItemSpec(layout=LayoutInfo("hparams.json", JsonSerialization(cls=cls)))}
    return CheckpointManager(cfg)


@pytest.mark.parametrize(
    ("cls", "field"), [(LoadedAsInt, r"hparams'\.n: the field is annotated int"), (LoadedWithNewField, "warmup")]
)
def test_a_class_that_no_longer_rebuilds_the_stored_json_is_a_template_mismatch(
    tmp_path: Path, cls: type, field: str
) -> None:
    with _manager(SavedV1) as saver:
        saver.save(str(tmp_path / "ck"), {"hparams": SavedV1(n=2.5, lr=0.1), "model": {"w": torch.ones(3)}})
    into: dict[str, object] = {"hparams": None, "model": {"w": torch.zeros(3)}}
    with _manager(cls) as loader, pytest.raises(TemplateMismatchError, match=field) as info:
        loader.load(str(tmp_path / "ck"), into=into)
    assert str(tmp_path / "ck" / "hparams.json") in str(info.value)
    assert "JsonSerialization()" in str(info.value)  # the way to get the stored JSON as it is
    assert not into["model"]["w"].any()  # type: ignore[index]  # refused in the check phase: nothing copied
