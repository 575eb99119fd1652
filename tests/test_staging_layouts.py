"""An async save takes every tensor a sync save takes: sparse, quantized and nested tensors too, and refuses what
a sync save refuses (a meta tensor: no values to restore).

The async stager copies tensors into one flat shared slab, which only dense tensors fit; the others made the
default (async) save fail with torch internals ("copy_() between dense and sparse Tensors is not implemented",
"Copying from quantized Tensor to non-quantized Tensor is not allowed", ...) while the same payload saved
synchronously. They are now copied on their own and travel to the writer by value; dense ones still use the slab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.staging import DefaultStager, SlabRef, TensorBytes, to_slab_refs
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

ODD: dict[str, Callable[[], torch.Tensor]] = {
    "sparse_coo": lambda: torch.eye(3).to_sparse(),
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.1, 0, torch.qint8),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)]),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.layout != b.layout or a.dtype != b.dtype or a.device != b.device or a.is_quantized != b.is_quantized:
        return False
    if a.is_quantized:
        same_scale = a.q_scale() == b.q_scale() and a.q_zero_point() == b.q_zero_point()
        return same_scale and torch.equal(a.int_repr(), b.int_repr())
    if a.is_nested:
        return all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))
    return torch.equal(a.to_dense(), b.to_dense())


@pytest.fixture(scope="module")
def async_manager() -> Iterator[CheckpointManager]:
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    manager = CheckpointManager(config)
    yield manager
    manager.close()


@pytest.mark.parametrize("kind", sorted(ODD))
def test_async_save_round_trips_what_the_slab_cannot_hold(
    async_manager: CheckpointManager, tmp_path: Path, kind: str
) -> None:
    odd, dense = ODD[kind](), torch.arange(6.0).reshape(2, 3)
    future = async_manager.save(str(tmp_path / "ck"), {"model": {"odd": odd, "dense": dense}})
    assert future is not None
    future.result(timeout=120)
    got = async_manager.load(str(tmp_path / "ck"))["model"]
    assert _same(got["odd"], ODD[kind]()), (kind, got["odd"])
    assert torch.equal(got["dense"], dense)


def test_an_async_save_refuses_a_meta_tensor_as_a_sync_save_does(
    async_manager: CheckpointManager, tmp_path: Path
) -> None:
    """A meta tensor has no values, so a checkpoint of it would restore nothing: both modes refuse it naming its
    path, at the save() call itself (the async save refused it only through its Future, after its writer process
    had started on it), and nothing is committed; the manager goes on."""
    value = {"model": {"odd": torch.empty(3, device="meta"), "dense": torch.ones(2)}}
    with pytest.raises(ValueError, match=r"'model::odd'.*meta tensor"):
        async_manager.save(str(tmp_path / "ck"), value)
    assert not (tmp_path / "ck").exists()
    future = async_manager.save(str(tmp_path / "ck"), {"model": {"dense": torch.ones(2)}})
    assert future is not None
    future.result(timeout=120)


def test_a_sparse_tensor_is_copied_as_of_save(async_manager: CheckpointManager, tmp_path: Path) -> None:
    """requires_copy=True holds for tensors outside the slab too: a change after save() returns is not saved."""
    odd = torch.eye(3).to_sparse().coalesce()
    future = async_manager.save(str(tmp_path / "ck"), {"model": {"odd": odd}})
    odd.values().add_(100)  # the live tensor changes while the write may still be running
    assert future is not None
    future.result(timeout=120)
    assert torch.equal(async_manager.load(str(tmp_path / "ck"))["model"]["odd"].to_dense(), torch.eye(3))


def test_dense_tensors_still_travel_through_the_slab() -> None:
    stager = DefaultStager()
    try:
        staged = stager.stage({"model": {"dense": torch.ones(4), "odd": ODD["quantized"]()}})
        slab = stager.slab
        assert slab is not None
        refs = to_slab_refs(staged["model"], slab)
        assert isinstance(refs["dense"], SlabRef)
        assert isinstance(refs["odd"], TensorBytes) and _same(refs["odd"].tensor(), ODD["quantized"]())
    finally:
        stager.close()


@pytest.mark.parametrize("kind", sorted(ODD))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_safetensors_refuses_what_it_cannot_store_naming_the_key(tmp_path: Path, kind: str, mode: str) -> None:
    """safetensors holds dense tensors only: a ValueError naming the key and the fix, not torch's internals."""
    from torch_checkpointing import ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization

    config = CheckpointManager.Config.with_sync_save() if mode == "sync" else CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.items = {"model": ItemSpec(layout=LayoutInfo("model.safetensors", SafetensorsSerialization()))}
    manager = CheckpointManager(config)
    try:
        with pytest.raises(ValueError, match=r"dense tensors only.*'model\.layer\.odd'.*TorchSerialization"):
            future = manager.save(str(tmp_path / "ck"), {"model": {"layer": {"odd": ODD[kind]()}}})
            if future is not None:
                future.result(timeout=120)
        assert not (tmp_path / "ck").exists()
    finally:
        with contextlib.suppress(Exception):
            manager.close()
