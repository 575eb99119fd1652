"""Round 22: a storage plugin whose reads fail in the middle of a load.

A custom `Storage` (configuring_checkpoints.md, pluggable storage) can fail at any read: a network error, an
expired token, the plugin's own bug. The load stays all or nothing (the reads happen in the check phase), but
what it raised was not the storage's failure: the plugin's exception came out bare, naming neither the file,
the item nor the storage (the default, verifying load of a direct item), or the decoder took it for the file's
bytes and said "the file is damaged or crafted. Load an earlier checkpoint" of an intact checkpoint (a resharding
load, or any load without verification). It is now an `ObjectStoreError` naming the file, the item and the
storage class, chained to the plugin's own exception.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import MemoryStorage, MemoryStorageConfig
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.storage.base_storage import ReadArgs

pytestmark = pytest.mark.filterwarnings("ignore:Item '.*' has plain \\(non-DTensor\\) tensors")


class BackendDown(Exception):
    """What a store's client raises (not an OSError: botocore's, a REST client's errors are not)."""


class FlakyStorage(MemoryStorage):
    """Reads of the `model` item's files fail while `failing` is set; every other read (the manifest, the
    metadata, the other item's file) works, so the load fails midway through its reads."""

    failing: Exception | None = None

    def _fail(self, path: Path) -> None:
        if FlakyStorage.failing is not None and Path(path).name.startswith("model_"):
            raise FlakyStorage.failing

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        self._fail(path)
        return super().read(path, read_args)

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        self._fail(path)
        return super().read_range(path, offset, length)


class FlakyStorageConfig(MemoryStorageConfig):
    def create_storage(self) -> FlakyStorage:
        return FlakyStorage(self.store)


class AlwaysReshard(DTensorResharder):
    """The engine's resharding job, run at an unchanged layout (one process)."""

    def should_reshard(self, source_metadata: Any, target_metadata: Any) -> bool:
        return source_metadata is not None and target_metadata is not None


SPECS = {
    "torch": ItemSpec(),
    "safetensors": ItemSpec(layout=LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization())),
    "resharded": ItemSpec(resharder=AlwaysReshard()),
}


def _templates() -> dict[str, dict[str, torch.Tensor]]:
    return {"other": {"x": torch.zeros(4)}, "model": {"a": torch.zeros(64), "b": torch.zeros(16)}}


# Failed before round 22: with verification (the default) the torch and safetensors items raised BackendDown
# itself, bare; the resharded item (and every kind, unverified) raised UndecodableFileError / CorruptCheckpointError
# "... is not a readable Torch file" / "the file is damaged or crafted. Load an earlier checkpoint", naming no storage.
@pytest.mark.parametrize("failure", [BackendDown("503 Slow Down"), ConnectionResetError(104, "Connection reset")])
@pytest.mark.parametrize("verify", [None, False])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_a_storage_failing_mid_load_is_named_and_changes_no_template(
    kind: str, verify: bool | None, failure: Exception
) -> None:
    config = FlakyStorageConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # an unverified load says so
        manager = CheckpointManager(
            CheckpointManager.Config(
                items={"other": ItemSpec(), "model": SPECS[kind]},
                storage_config=config,
                save=SyncCheckpointSaverConfig(),
                load=CheckpointLoaderConfig(verify_checksums=verify),
            )
        )
    with manager:
        manager.save("/ck", {"other": {"x": torch.ones(4)}, "model": {"a": torch.ones(64), "b": torch.ones(16)}})
        templates = _templates()
        FlakyStorage.failing = failure
        try:
            with pytest.raises(ObjectStoreError) as info:
                manager.load("/ck", into=templates)
        finally:
            FlakyStorage.failing = None
        loaded = manager.load("/ck", into=_templates())  # the checkpoint is intact: it loads once the store works
    said = str(info.value)
    assert "model_0." in said and "item 'model'" in said and "FlakyStorage" in said and str(failure) in said, said
    assert "damaged" not in said.replace("not found damaged", ""), said
    assert info.value.__cause__ is failure
    assert all(torch.equal(t, torch.zeros_like(t)) for entries in templates.values() for t in entries.values())
    assert torch.equal(loaded["model"]["a"], torch.ones(64))
