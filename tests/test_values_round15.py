"""Value fidelity defects found in round 15, each with the test that failed before its fix.

* A float/int/str subclass (numpy's float64, an IntEnum) or a tensor subclass saved with TorchSerialization got
  no save-time warning, though torch's safe loader refuses it and the load then failed at resume time.
* An async save wrote a different file than a sync save: a tensor subclass was silently stripped to a plain
  tensor, a jagged nested tensor failed in the writer with torch's unpickler message, and an mkldnn tensor failed
  with a bare NotImplementedError naming no item (sync names it).
* Templates copy_() cannot fill were not all refused before the first copy: an unfolded view whose elements
  share memory was filled silently with wrong values; a sparse CSR template of another element count, a
  quantized one of another scheme, and any nested one raised torch's RuntimeError, after earlier items had been
  overwritten.
"""

from __future__ import annotations

import enum
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing import CheckpointManager, TemplateMismatchError
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig


class Tagged(torch.Tensor):
    """A tensor subclass made by `as_subclass`, as user code makes them."""


class Colour(enum.IntEnum):
    RED = 1


def _manager(sync: bool) -> CheckpointManager:
    save = SyncCheckpointSaverConfig() if sync else AsyncCheckpointSaverConfig()
    return CheckpointManager(CheckpointManager.Config(save=save))


@pytest.fixture
def sync_manager() -> Iterator[CheckpointManager]:
    with _manager(True) as manager:
        yield manager


def _save(manager: CheckpointManager, path: Path, state: dict[str, Any]) -> None:
    future = manager.save(str(path), state)
    if future is not None:
        future.result(timeout=120)


# ------------------------------------------------------------------------------------ the safe-load warning


@pytest.mark.parametrize(
    "value",
    [np.float64(0.25), Colour.RED, torch.ones(2).as_subclass(Tagged)],
    ids=["numpy-float64", "IntEnum", "tensor-subclass"],
)
def test_a_subclass_of_an_always_loaded_type_is_warned_about_at_save(
    tmp_path: Path, sync_manager: CheckpointManager, value: Any
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sync_manager.save(str(tmp_path / "ck"), {"stats": {"loss": value}})
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "stats" in str(w.message)]
    assert said, [str(w.message) for w in caught]


def test_exact_plain_types_are_not_warned_about(tmp_path: Path, sync_manager: CheckpointManager) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = {"stats": {"loss": 0.25, "n": 3, "w": torch.ones(2), "p": torch.nn.Parameter(torch.ones(2))}}
        sync_manager.save(str(tmp_path / "ck"), state)
    assert not [w for w in caught if "stats" in str(w.message)], [str(w.message) for w in caught]


# ---------------------------------------------------------------------------- sync and async write one file


def test_an_async_save_keeps_a_tensor_subclass_as_a_sync_save_does(tmp_path: Path) -> None:
    for sync in (True, False):
        with _manager(sync) as manager, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _save(manager, tmp_path / f"ck{sync}", {"model": {"t": torch.arange(3.0).as_subclass(Tagged)}})
        stored = torch.load(tmp_path / f"ck{sync}" / "model_0.pt", weights_only=False)["t"]
        assert type(stored) is Tagged and torch.equal(stored.as_subclass(torch.Tensor), torch.arange(3.0)), sync


def test_an_async_save_of_a_jagged_nested_tensor_loads_as_a_sync_one_does(tmp_path: Path) -> None:
    parts = [torch.arange(2.0), torch.arange(3.0)]
    for sync in (True, False):
        with _manager(sync) as manager, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _save(
                manager,
                tmp_path / f"ck{sync}",
                {"model": {"t": torch.nested.nested_tensor(parts, layout=torch.jagged)}},
            )
            loaded = manager.load(str(tmp_path / f"ck{sync}"))["model"]["t"]
        assert loaded.is_nested and [torch.equal(a, b) for a, b in zip(loaded.unbind(), parts, strict=True)] == [
            True,
            True,
        ], sync


def test_an_async_save_of_an_mkldnn_tensor_fails_naming_the_item(tmp_path: Path) -> None:
    with _manager(False) as manager:
        future = manager.save(str(tmp_path / "ck"), {"model": {"t": torch.ones(2).to_mkldnn()}})
        assert future is not None
        with pytest.raises(pickle.PicklingError, match="'model'"):
            future.result(timeout=120)
    assert not (tmp_path / "ck").exists()


# ------------------------------------------------------------------------ templates refused before any copy


def _unfolded() -> torch.Tensor:
    return torch.zeros(10).unfold(0, 4, 3)  # rows overlap by one element; no stride is 0


BAD: dict[str, tuple[torch.Tensor, Callable[[], torch.Tensor], str]] = {
    "unfolded": (torch.arange(1.0, 13.0).reshape(3, 4), _unfolded, "share memory"),
    "csr-element-count": (torch.eye(3).to_sparse_csr(), lambda: torch.zeros(3, 3).to_sparse_csr(), "stored elements"),
    "qscheme": (
        torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 2, torch.quint8),
        lambda: torch.quantize_per_channel(
            torch.zeros(2), torch.tensor([0.1, 0.1]), torch.tensor([0, 0]), 0, torch.quint8
        ),
        "Quantization mismatch",
    ),
    "nested-shapes": (
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(4)]),
        "component shapes",
    ),
    "nested-into-dense": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), lambda: torch.zeros(5), "Nested"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_template_copy_cannot_fill_refuses_the_load_before_any_copy(
    tmp_path: Path, sync_manager: CheckpointManager, bad: str
) -> None:
    saved, make, says = BAD[bad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sync_manager.save(str(tmp_path / "ck"), {"a": {"w": torch.arange(3.0)}, "b": {"x": saved}})
    first, template = torch.zeros(3), make()
    before = template.clone() if template.layout == torch.strided and not template.is_nested else None
    with pytest.raises(TemplateMismatchError, match=says) as raised:
        sync_manager.load(str(tmp_path / "ck"), into={"a": {"w": first}, "b": {"x": template}})
    assert "b::x" in str(raised.value)
    assert torch.equal(first, torch.zeros(3))  # nothing was copied, not even the item before
    if before is not None:
        assert torch.equal(template, before)


def test_a_nested_template_of_the_saved_shapes_is_filled(tmp_path: Path, sync_manager: CheckpointManager) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = torch.nested.nested_tensor([torch.ones(2), torch.full((3,), 2.0)])
        sync_manager.save(str(tmp_path / "ck"), {"b": {"x": saved}})
        template = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
        loaded = sync_manager.load(str(tmp_path / "ck"), into={"b": {"x": template}})
    assert loaded["b"]["x"] is template
    assert [t.tolist() for t in template.unbind()] == [[1.0, 1.0], [2.0, 2.0, 2.0]]


def test_an_interleaved_template_whose_elements_do_not_share_memory_is_filled(
    tmp_path: Path, sync_manager: CheckpointManager
) -> None:
    """Strides (2, 3) over sizes (3, 2) interleave without sharing (offsets 0,3,2,5,4,7): not refused."""
    sync_manager.save(str(tmp_path / "ck"), {"b": {"x": torch.arange(6.0).reshape(3, 2)}})
    template = torch.zeros(8).as_strided((3, 2), (2, 3))
    sync_manager.load(str(tmp_path / "ck"), into={"b": {"x": template}})
    assert torch.equal(template, torch.arange(6.0).reshape(3, 2))


def test_a_tensor_subclass_in_a_safetensors_item_is_stored_as_its_data_by_both_modes(tmp_path: Path) -> None:
    """The guard from the other side: a safetensors file holds data only, as before, in either mode."""
    from torch_checkpointing import ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization

    items = {"model": ItemSpec(layout=LayoutInfo("model.safetensors", SafetensorsSerialization()))}
    for sync in (True, False):
        save = SyncCheckpointSaverConfig() if sync else AsyncCheckpointSaverConfig()
        with CheckpointManager(CheckpointManager.Config(items=items, save=save)) as manager:
            _save(manager, tmp_path / f"ck{sync}", {"model": {"t": torch.arange(3.0).as_subclass(Tagged)[1:]}})
            loaded = manager.load(str(tmp_path / f"ck{sync}"))["model"]["t"]
        assert type(loaded) is torch.Tensor and torch.equal(loaded, torch.arange(1.0, 3.0)), sync


def test_a_dtensor_is_judged_as_the_local_shard_its_file_holds(tmp_path: Path, mesh: Any) -> None:
    """The guard from the other side of the exact-type rule: a file holds a DTensor's local shard, which the
    safe loader takes, so saving one warns of nothing (judging the DTensor itself warned on every save)."""
    from torch.distributed.tensor import DTensor, Shard

    value = DTensor.from_local(torch.arange(4.0), mesh, [Shard(0)])
    with _manager(True) as manager, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(str(tmp_path / "ck"), {"model": {"w": value}})
        loaded = manager.load(str(tmp_path / "ck"))
    assert not [str(w.message) for w in caught if "model" in str(w.message)]
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0))


def test_the_partial_load_warning_says_a_safetensors_list_entry_comes_back_as_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The entry is None by the design document's rule; the warning said it was "left as it was"."""
    import logging

    from torch_checkpointing import ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization

    items = {"x": ItemSpec(layout=LayoutInfo("x.safetensors", SafetensorsSerialization()))}
    with CheckpointManager(CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "ck"), {"x": {"a": [torch.ones(1), torch.ones(1)]}})
        template = [torch.zeros(1), torch.zeros(1), torch.full((1,), 7.0)]
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            loaded = manager.load(str(tmp_path / "ck"), into={"x": {"a": template}})
    assert loaded["x"]["a"][2] is None
    said = [r.getMessage() for r in caplog.records if "restored partially" in r.getMessage()]
    assert len(said) == 1 and "x::a.2" in said[0] and "None" in said[0], said


# ------------------------------------------------------------------------------- documented error types


def test_a_cycle_found_in_the_async_writer_reaches_the_caller_as_a_nesting_error(tmp_path: Path) -> None:
    """Before: after the writer's first save, a requires_copy=False value holding a cycle failed its Future with
    a RuntimeError (NestingError did not survive the trip back from the writer process)."""
    from torch_checkpointing import ItemSpec
    from torch_checkpointing.traversal import NestingError

    cycle: list[Any] = []
    cycle.append(cycle)
    items = {"a": ItemSpec(), "b": ItemSpec(requires_copy=False)}
    with CheckpointManager(CheckpointManager.Config(items=items, save=AsyncCheckpointSaverConfig())) as manager:
        _save(manager, tmp_path / "warm", {"a": torch.ones(1), "b": 1})
        with pytest.raises(NestingError, match="contains itself") as raised:
            _save(manager, tmp_path / "x", {"a": torch.ones(1), "b": cycle})
    assert "'b::0'" in str(raised.value), raised.value
    assert not (tmp_path / "x").exists()


def test_a_nul_in_a_layout_path_is_refused_naming_the_key_before_anything_is_written(
    tmp_path: Path, sync_manager: CheckpointManager
) -> None:
    from torch_checkpointing import ConfigError, ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization

    sync_manager.config.items = {"a": ItemSpec(layout=LayoutInfo("a\x00.pt", TorchSerialization()))}
    with pytest.raises(ConfigError, match=r"'a'.*NUL"):
        sync_manager.save(str(tmp_path / "ck"), {"a": torch.ones(1)})
    assert not (tmp_path / "ck").exists() and not list(tmp_path.iterdir())


def test_a_load_of_an_item_the_checkpoint_lacks_is_a_key_error(tmp_path: Path, sync_manager: CheckpointManager) -> None:
    """operations.md: such a load "raises a KeyError that lists the keys it does have"."""
    from torch_checkpointing import TemplateMismatchError

    sync_manager.save(str(tmp_path / "ck"), {"a": torch.ones(1)})
    with pytest.raises(KeyError) as raised:
        sync_manager.load(str(tmp_path / "ck"), into={"a": None, "b": None})
    assert isinstance(raised.value, TemplateMismatchError)
    assert "'b'" in str(raised.value) and "'a'" in str(raised.value) and not str(raised.value).startswith('"')


@pytest.mark.parametrize("where", ["bogus", "cpu:3", "cuda", {"cuda:0": "cuda:7"}])
def test_a_map_location_this_machine_cannot_use_is_a_config_error_not_a_corrupt_file(
    tmp_path: Path, sync_manager: CheckpointManager, where: Any
) -> None:
    """Before: a CorruptCheckpointError ("not a readable Torch file"), so a fallback took an intact checkpoint
    for a damaged one."""
    from torch_checkpointing import ConfigError

    if torch.cuda.is_available() and where == "cuda":
        pytest.skip("this machine has a CUDA device: 'cuda' is a device it can use")
    sync_manager.save(str(tmp_path / "ck"), {"a": torch.ones(1)})
    with pytest.raises(ConfigError, match="map_location"):
        sync_manager.load(str(tmp_path / "ck"), into={"a": None}, map_location=where)
