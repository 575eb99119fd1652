"""A custom resharder's metadata that JSON cannot hold faithfully: refused at save, naming where, creating nothing.

Before: a set, a tensor or an `object()` in `ShardingMetadata.to_dict()` failed rank 0's save with a bare
`TypeError: Object of type set is not JSON serializable` (no item, no resharder, no fix) after the id's parent
directories had been made, and they stayed; a NaN or an infinity was written as the non-standard `NaN` into
metadata.json, so the save committed a checkpoint that `load()`, `verify` and `inspect` then refused as "damaged or
crafted"; an int key came back as a str.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ConfigError, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import ShardingMetadata
from torch_checkpointing.resharding import Resharder


@dataclass(frozen=True)
class _Position(ShardingMetadata, type_name="Round19Position"):
    value: Any

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> _Position:
        return cls(d["value"])

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None


@dataclass(frozen=True)
class _FailsOnceMade(ShardingMetadata, type_name="Round19FailsOnceMade"):
    """A to_dict that fails once `made` exists: rank 0 serializes the metadata after it made the id's parents."""

    made: str

    def to_dict(self) -> dict[str, Any]:
        if os.path.isdir(self.made):
            raise RuntimeError("the loader's position is gone")
        return {"n": 1}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> _FailsOnceMade:
        return cls("")

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None


class _Describes(Resharder):
    def __init__(self, meta: ShardingMetadata) -> None:
        self.meta = meta

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[Any, Any]:
        return {("position",): self.meta}

    def load(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("not loaded here")


def _save(root: Path, meta: ShardingMetadata) -> None:
    items = {"loader": ItemSpec(resharder=_Describes(meta))}
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), items=items)) as manager:
        manager.save(str(root / "new" / "run" / "step_1"), {"loader": {"position": 3}})


def _created(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({1, 2}, "set"),
        (torch.ones(2), "Tensor"),
        (object(), "object"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        ({1: "a"}, "key 1"),
    ],
    ids=["set", "tensor", "object", "nan", "inf", "int-key"],
)
def test_metadata_json_cannot_hold_is_refused_naming_the_resharder_item_and_field(
    tmp_path: Path, value: Any, named: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        _save(tmp_path, _Position(value))
    message = str(raised.value)
    for part in ("_Describes", "'loader'", "position", "_Position.to_dict", named):
        assert part in message, message
    assert _created(tmp_path) == [], _created(tmp_path)  # not even the id's parents


def test_a_failure_after_the_parents_were_made_removes_them(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the loader's position is gone"):
        _save(tmp_path, _FailsOnceMade(str(tmp_path / "new")))
    assert _created(tmp_path) == [], _created(tmp_path)


def test_metadata_that_json_holds_still_saves_and_loads(tmp_path: Path) -> None:
    _save(tmp_path, _Position({"epoch": 2, "seen": [1.5, None, True, "x"], "order": (3, 4)}))
    assert (tmp_path / "new" / "run" / "step_1" / "metadata.json").is_file()
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        out = manager.load(str(tmp_path / "new" / "run" / "step_1"), into={"loader": None})
    assert out == {"loader": {"position": 3}}


def _nested(levels: int) -> dict[str, Any]:
    """`levels` values deep, counting the innermost number, as a load's metadata.json reader counts."""
    value: Any = 1
    for _ in range(levels - 1):
        value = {"k": value}
    return value


def test_metadata_as_deep_as_a_load_reads_saves_and_verifies_deeper_is_refused(tmp_path: Path) -> None:
    from torch_checkpointing.cli import main
    from torch_checkpointing.distributed_metadata import STORED_DATA_DEPTH

    # to_dict() is {"value": v}: one level more than v
    _save(tmp_path / "deepest", _Position(_nested(STORED_DATA_DEPTH - 1)))
    assert main(["verify", str(tmp_path / "deepest" / "new" / "run" / "step_1")]) == 0
    with pytest.raises(ConfigError, match=f"nests deeper than {STORED_DATA_DEPTH} levels"):
        _save(tmp_path / "deeper", _Position(_nested(STORED_DATA_DEPTH)))
    assert not (tmp_path / "deeper").exists()


def test_metadata_larger_than_a_load_reads_is_refused_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch_checkpointing.metadata_manager as metadata_manager

    monkeypatch.setattr(metadata_manager, "MAX_METADATA_BYTES", 400)  # the real bound is 256 MiB
    with pytest.raises(ConfigError, match="larger than a load reads back"):
        _save(tmp_path, _Position("x" * 400))
    assert _created(tmp_path) == [], _created(tmp_path)
