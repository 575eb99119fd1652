"""A load racing a delete of its checkpoint on S3 fails with a CheckpointError naming the checkpoint, never a
raw FileNotFoundError or botocore's NoSuchKey. Real DELETEs against a real S3 server (moto on loopback), issued
between two requests of the load (`DeletingS3FileSystem`): after the manifest's HEAD or GET, after the first
part of a multi-GET read, and under a resharding load that fetches byte ranges.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_faults import DeletingS3FileSystem
from tests.s3_server import TEST_PART_SIZE, S3Server
from tests.test_verified_loads import AlwaysReshard
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

N = 3 * TEST_PART_SIZE // 4 // 4 * 2  # float32s: a file of 1.5 parts, read with two GETs
RESHARD = ItemSpec(resharder=AlwaysReshard(), layout=LayoutInfo("model/{rank}.safetensors", SafetensorsSerialization()))


def _manager(config: FsspecStorageConfig, resharded: bool) -> CheckpointManager:
    items = {"model": RESHARD} if resharded else {}
    return CheckpointManager(
        CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), storage_config=config)
    )


def _state() -> dict[str, Any]:
    return {"model": {"w": torch.arange(N, dtype=torch.float32)}}


@pytest.mark.parametrize(
    ("resharded", "trigger", "after"),
    [
        (False, "manifest.json", "head"),  # between the manifest's HEAD and its GET
        (False, "manifest.json", "get"),  # between the manifest and the data files
        (False, "model_0.pt", "get"),  # between two GETs of one data file
        (True, "manifest.json", "get"),  # a resharding load's ranged reads
        (True, "model/0.safetensors", "get"),
    ],
)
def test_a_load_racing_a_delete_fails_naming_the_checkpoint(
    s3_server: S3Server, resharded: bool, trigger: str, after: str
) -> None:
    base = s3_server.config(max_concurrency=1)
    with _manager(base, resharded) as manager, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        manager.save("run/step_1", _state())
    prefix = base.create_storage().remap_path(Path("run/step_1")).split("://", 1)[1]
    fs = DeletingS3FileSystem(**s3_server.storage_options(), prefix=prefix, trigger=f"{prefix}/{trigger}", after=after)
    racing = FsspecStorageConfig(**{**vars(base), "filesystem": fs})
    into = {"model": {"w": torch.zeros(N)}}
    with _manager(racing, resharded) as manager, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        with pytest.raises(Exception) as caught:
            manager.load("run/step_1", into=into, strict=False)
    assert fs.deleted, "the delete never ran: the load did not make the request it was to race"
    error = caught.value
    assert isinstance(error, CheckpointError), f"{type(error).__name__} escaped: {error}"
    assert "run/step_1" in str(error), str(error)
