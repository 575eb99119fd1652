"""A load whose checkpoint names a sharding type that no class imported in the loading program registers.

Before: `CorruptCheckpointError("Sharding metadata .../metadata.json is malformed (ValueError: ... Unknown
ShardingMetadata type ...)")` for a healthy checkpoint: the error type told an operator to load an earlier checkpoint
(and tools built on it to delete this one) when the fix is an import in the loading program.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_cli_custom_sharding_round19 import TYPE, _LoaderResharder
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import ShardingMetadata
from torch_checkpointing.errors import ConfigError, CorruptCheckpointError


class _Resharder(_LoaderResharder):
    def load(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the load must refuse before any resharder runs")


def test_an_unregistered_sharding_type_is_the_programs_omission_not_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), items={"loader": ItemSpec(resharder=_Resharder())}
    )
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "a"), {"loader": {"position": 3, "seen": torch.arange(4.0)}})
        monkeypatch.delitem(ShardingMetadata._registry, TYPE)  # the loading program never imported the class
        template = {"position": 0, "seen": torch.zeros(4)}
        with pytest.raises(ConfigError) as info:
            manager.load(str(tmp_path / "a"), into={"loader": template})
    assert not isinstance(info.value, CorruptCheckpointError)
    message = str(info.value)
    assert TYPE in message and "'loader'" in message and "import the module" in message
    assert "metadata.json" in message
    assert template["position"] == 0 and torch.equal(template["seen"], torch.zeros(4))
