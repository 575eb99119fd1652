"""A NaN dict key names no location: refused at save and by `CheckpointPath`'s JSON form (round 31).

NaN is unequal to itself, so a NaN dict key can never be found again by value: `CheckpointPath("k", (nan,))`
serialized to `["k",NaN]` (no JSON) and compared unequal after the round trip, and a value saved with a NaN key
loaded into a template holding one "partially" (the entry reported both missing and extra, two NaN keys in the
dict). Every other float key round-trips, and is kept: inf (JSON's reader in Python gives it back), -0.0 (equal
to 0.0 as a dict key: the template's key is kept), and 1 / 1.0 / True (one dict key: the template's is kept).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.types import CheckpointPath

_NAN = float("nan")


def _manager() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig()))


@pytest.mark.parametrize("path", [(_NAN,), ("a", (1, _NAN))], ids=["nan", "nan-in-tuple-key"])
def test_serialize_refuses_a_nan_component(path: tuple[Any, ...]) -> None:
    """Defect: serialize() returned '["k",NaN]', which is no JSON and deserializes to an unequal path."""
    with pytest.raises(ConfigError, match=r"NaN.*rename"):
        CheckpointPath("k", path).serialize()


def test_deserialize_refuses_nan() -> None:
    """Defect: '["k",NaN]' was taken, as a path unequal to any other."""
    with pytest.raises(ConfigError, match="Cannot deserialize"):
        CheckpointPath.deserialize('["k",NaN]')


@pytest.mark.parametrize(
    "value",
    [{_NAN: torch.ones(2)}, {"a": [{"b": 1, _NAN: 2}]}, {(1, _NAN): 3}],
    ids=["top", "nested", "in-a-tuple-key"],
)
def test_save_refuses_a_nan_dict_key(tmp_path: Path, value: Any) -> None:
    """Defect: the save committed; a load into a template with the NaN key restored it "partially"."""
    with _manager() as manager, pytest.raises(ConfigError, match=r"item 'm'.*NaN.*Rename"):
        manager.save(str(tmp_path / "ck"), {"m": value})
    assert list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("key", [math.inf, -math.inf, -0.0, 1e300], ids=["inf", "-inf", "-0.0", "1e300"])
def test_other_float_components_round_trip(key: float) -> None:
    path = CheckpointPath("k", (key, (key, "x")))
    back = CheckpointPath.deserialize(path.serialize())
    assert back == path and math.copysign(1, back.nested_path[0]) == math.copysign(1, key)


@pytest.mark.parametrize(
    ("saved", "template"), [(-0.0, 0.0), (1, 1.0), (1, True), (True, 1)], ids=["-0.0/0.0", "1/1.0", "1/True", "True/1"]
)
def test_an_equal_key_fills_the_templates_entry(tmp_path: Path, saved: Any, template: Any) -> None:
    with _manager() as manager:
        manager.save(str(tmp_path / "ck"), {"m": {saved: torch.ones(2)}, "s": {saved: "x"}})
        into = {"m": {template: torch.zeros(2)}}
        out = manager.load(str(tmp_path / "ck"), into, strict=False)
        loaded = manager.load(str(tmp_path / "ck"))
    (key,) = out["m"]
    assert type(key) is type(template) and torch.equal(into["m"][template], torch.ones(2))
    (back,) = loaded["s"]
    assert type(back) is type(saved) and str(back) == str(saved)


def test_an_async_save_refuses_a_nan_key_through_its_future(tmp_path: Path) -> None:
    """The writer process's encode refuses it: the Future raises the same ConfigError, nothing is committed, and
    the next save works. Not from save() itself: the search walks every container of the item, and on the
    trainer's thread it made a no-copy save of an Adam state of 2,000 parameters block ~4 ms instead of ~0.5."""
    from torch_checkpointing.config import AsyncCheckpointSaverConfig

    config = CheckpointManager.Config(save=AsyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
    with CheckpointManager(config) as manager:
        future = manager.save(str(tmp_path / "ck"), {"m": {"a": {_NAN: 1}}})
        with pytest.raises(ConfigError, match=r"item 'm'.*NaN.*Rename"):
            future.result()
        manager.save(str(tmp_path / "ok"), {"m": {"a": 1}}).result()
    assert [info.path for info in list_checkpoints(tmp_path)] == [str(tmp_path / "ok")]
