"""A resharding load from a real S3 server (moto on loopback) whose server fails between two block reads.

A resharded item's blocks are fetched with ranged GETs. Where the check phase does not keep them for the copy
phase (an unverified load, or more bytes than the check phase may keep), the copy phase fetched them again,
one block after another, copying each into the template as it came: a server that answered 500 (or whose
object was replaced) after the first block left that block copied and the rest as the template had it, and
raised; on several ranks the others went on. The promise is all or nothing: the error names the object, and
no template changed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import through_proxy
from tests.test_verified_loads import AlwaysReshard
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.source_reader import SourceTensor
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

LAYOUT = LayoutInfo("model/{rank}.safetensors", SafetensorsSerialization())


def _manager(config: FsspecStorageConfig, **load: Any) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(resharder=AlwaysReshard(), layout=LAYOUT)},
            save=SyncCheckpointSaverConfig(),
            load=CheckpointLoaderConfig(**load),
            storage_config=config,
        )
    )


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.port) as p:
        yield p


def _fail_gets_after_the_first_block_read(monkeypatch: pytest.MonkeyPatch, proxy: FaultProxy) -> list[str]:
    """From the first block read on, every GET of the model file answers 500 (a real HTTP error from the proxy)."""
    seen: list[str] = []
    real = SourceTensor.read_block

    def read_block(self: SourceTensor, offsets: Any, sizes: Any, stats: Any) -> torch.Tensor:
        block = real(self, offsets, sizes, stats)
        if not seen:
            seen.append("first block read")
            proxy.rules = [Rule(r"^GET \S*/model/0\.safetensors", 500, "InternalError")]
        return block

    monkeypatch.setattr(SourceTensor, "read_block", read_block)
    return seen


# An unverified load fetches in the copy phase; a verified one when its blocks are more than it keeps.
@pytest.mark.parametrize(("verify", "n"), [(False, 64 * 1024), (None, 2 * 1024 * 1024)])
def test_a_server_failing_between_two_block_reads_changes_no_template(
    s3_server: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, verify: bool | None, n: int
) -> None:
    config = through_proxy(s3_server.config(), proxy)
    values = {"a": torch.arange(n, dtype=torch.float32), "b": torch.arange(n, dtype=torch.float32) + 0.5}
    ckpt = f"reshard-midread-{verify}/step_1"
    with _manager(config) as m, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        m.save(ckpt, {"model": values})
    if verify is None:  # a verified load keeps what its check phase fetched up to a budget: set it to nothing
        monkeypatch.setattr("torch_checkpointing.read_context.PREFETCH_BUDGET_BYTES", 0)
    seen = _fail_gets_after_the_first_block_read(monkeypatch, proxy)
    target = {"a": torch.zeros(n), "b": torch.zeros(n)}
    with _manager(config, verify_checksums=verify) as m, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        with pytest.raises(CheckpointError, match=r"model/0\.safetensors"):
            m.load(ckpt, into={"model": target})
    assert seen, "no block was read: the fault never came between two reads"
    assert not target["a"].any() and not target["b"].any(), "a failed load changed the template"
    proxy.rules = []
    with _manager(config, verify_checksums=verify) as m, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        m.load(ckpt, into={"model": target})  # the store answers again: the same load simply works
    assert torch.equal(target["a"], values["a"]) and torch.equal(target["b"], values["b"])
