"""A sync and an async save write the same torch file: plain local tensors, which load in any process.

Before, a sync save pickled the payload as given: DTensors (with their DeviceMesh), `nn.Parameter`s and
`requires_grad` flags, while the async stager wrote plain local tensors. So the same `save()` wrote two
different checkpoints depending on the saver, and a sync-saved DTensor checkpoint could not be loaded by a
process that had not imported torch.distributed.tensor (an eval script, `python -m torch_checkpointing
inspect`): "RefusedPickleError ... torch.distributed.tensor must be imported to load DTensors". Files written
that way before (or by the published release) still load: the module is imported when torch asks for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes import fresh_json
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

_LOAD_IN_A_FRESH_PROCESS = """
import json, sys
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
config = CheckpointManager.Config.with_sync_save()
config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
m = CheckpointManager(config)
try:
    got = m.load(sys.argv[1])
    kinds = {k: {n: [type(t).__name__, t.requires_grad, t.tolist()] for n, t in v.items()} for k, v in got.items()}
    print(json.dumps(kinds))
finally:
    m.close()
"""


def _payload(mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "model": {"w": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])},
        "head": {"p": torch.nn.Parameter(torch.ones(2)), "g": torch.full((2,), 3.0, requires_grad=True)},
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_checkpoint_of_dtensors_loads_in_a_process_without_torch_distributed(
    mesh: Any, tmp_path: Path, mode: str
) -> None:
    config = CheckpointManager.Config.with_sync_save() if mode == "sync" else CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    manager = CheckpointManager(config)
    try:
        future = manager.save(str(tmp_path / "ck"), _payload(mesh))
        if future is not None:
            future.result(timeout=120)
    finally:
        manager.close()
    got = fresh_json(_LOAD_IN_A_FRESH_PROCESS, str(tmp_path / "ck"))
    assert got == {
        "model": {"w": ["Tensor", False, [0.0, 1.0, 2.0, 3.0]]},
        "head": {"p": ["Tensor", False, [1.0, 1.0]], "g": ["Tensor", False, [3.0, 3.0]]},
    }


def test_a_file_holding_pickled_dtensors_still_loads_in_a_fresh_process(mesh: Any, tmp_path: Path) -> None:
    """What an earlier sync save (and the published release) wrote: the DTensor itself, pickled."""
    manager = CheckpointManager(
        CheckpointManager.Config(
            save=CheckpointManager.Config.with_sync_save().save,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )
    try:
        manager.save(str(tmp_path / "ck"), {"model": {"w": torch.zeros(4)}})
    finally:
        manager.close()
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.save({"w": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}, tmp_path / "old.pt")
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from torch_checkpointing.codecs import DecodeOptions, load_torch\n"
        "from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig\n"
        "storage = LocalFileSystemStorageConfig(use_direct_io=False).create_storage()\n"
        "value = load_torch(storage, Path(sys.argv[1]), 'an old file', DecodeOptions())\n"
        "print(json.dumps(value['w'].to_local().tolist()))\n"
    )
    assert fresh_json(code, str(tmp_path / "old.pt")) == [0.0, 1.0, 2.0, 3.0]
