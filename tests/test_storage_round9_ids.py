"""An id relative to an fsspec storage's url root stays under that root.

`..` in a relative id was normalised away: under `url=s3://b/runs/exp1`, `../exp2/step_1` wrote to
`s3://b/runs/exp2/step_1` (and enough `..` reached another bucket), outside the root that retention, `ls` and
gc of this run look at. Checked on fsspec's in-process memory filesystem: name resolution is the same code for
every scheme.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

ROOT = "memory://round9-ids/runs/exp1"


@pytest.mark.parametrize("checkpoint_id", ["../exp2/step_1", "step_1/../../exp2", "a/../../../../elsewhere"])
def test_an_id_that_steps_out_of_the_root_is_refused_naming_both(checkpoint_id: str) -> None:
    storage = FsspecStorage(FsspecStorageConfig(url=ROOT))
    with pytest.raises(ConfigError, match=r"leaves this storage's url root .*round9-ids/runs/exp1") as refused:
        storage.remap_path(Path(checkpoint_id))
    assert checkpoint_id in str(refused.value)


@pytest.mark.parametrize("checkpoint_id", ["step_1", "sub/step_1", "sub/../step_1", "./step_2"])
def test_ids_inside_the_root_resolve_under_it(checkpoint_id: str) -> None:
    storage = FsspecStorage(FsspecStorageConfig(url=ROOT))
    name = storage.remap_path(Path(checkpoint_id)).removeprefix("memory:").lstrip("/")
    assert name.startswith("round9-ids/runs/exp1/")


def test_a_save_to_an_id_outside_the_root_writes_nothing() -> None:
    config = FsspecStorageConfig(url=ROOT)
    manager = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config))
    try:
        with pytest.raises(ConfigError, match="leaves this storage's url root"):
            manager.save("../exp2/step_1", {"model": {"w": torch.ones(2)}})
        manager.save("step_1", {"model": {"w": torch.ones(2)}})
        assert float(manager.load("step_1")["model"]["w"][0]) == 1.0
    finally:
        manager.close()
    fs = FsspecStorage(config).fs
    assert not fs.exists("/round9-ids/runs/exp2")
