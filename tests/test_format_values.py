"""Unusual values through the four formats: `load()` gives back exactly what was saved, or `save()` refuses
with a ValueError/TypeError naming the key and the fix. Never a committed file that no load reads back.

Each test here failed before its fix: a safetensors tensor named `__metadata__` and the dtypes safetensors
writes but cannot read back (float8_e8m0fnu, float4_e2m1fn_x2) were committed and then failed every load;
deep or self-containing JSON failed the save with a bare RecursionError, and an over-long int with a
ValueError naming nothing; a torch dtype `torch.save` has no name for was a bare KeyError.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import MemoryStorageConfig
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    SafetensorsSerialization,
    SerializationFormat,
    TorchSerialization,
)
from torch_checkpointing.codecs import JSON_MAX_DEPTH
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import IncompleteCheckpointError, TemplateMismatchError
from torch_checkpointing.storage.base_storage import StorageConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def _manager(fmt: SerializationFormat, storage: StorageConfig | None) -> CheckpointManager:
    layout = LayoutInfo("item.bin", fmt)
    return CheckpointManager(
        CheckpointManager.Config(
            items={"item": ItemSpec(layout=layout)}, save=SyncCheckpointSaverConfig(), storage_config=storage
        )
    )


def _storages(tmp_path: Path) -> list[StorageConfig]:
    """An object store's read path (bytes) and a local file's (memory-mapped)."""
    return [MemoryStorageConfig(), LocalFileSystemStorageConfig(use_direct_io=False)]


def _round_trip(fmt: SerializationFormat, value: Any, storage: StorageConfig, where: str, into: Any = None) -> Any:
    manager = _manager(fmt, storage)
    try:
        manager.save(where, {"item": value})
        return manager.load(where, into={"item": into})["item"]
    finally:
        manager.close()


def _refused_and_not_committed(fmt: SerializationFormat, value: Any, exc: type, match: str, tmp_path: Path) -> None:
    """The save raises `exc` matching `match`, and nothing is left that a load would take for a checkpoint."""
    manager = _manager(fmt, LocalFileSystemStorageConfig(use_direct_io=False))
    try:
        with pytest.raises(exc, match=match):
            manager.save(str(tmp_path / "ck"), {"item": value})
        with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
            manager.load(str(tmp_path / "ck"))
    finally:
        manager.close()


def _bytes(t: torch.Tensor) -> list[int]:
    return list(t.contiguous().untyped_storage())


# --------------------------------------------------------------------------------------------- safetensors


def test_safetensors_refuses_a_tensor_named_like_the_metadata_header(tmp_path: Path) -> None:
    """safetensors keeps `__metadata__` for the header's str->str map: a tensor under that name was written,
    committed, and then every load failed ('invalid JSON in header'), with or without user metadata."""
    for fmt in (SafetensorsSerialization(), SafetensorsSerialization(metadata={"v": "1"})):
        value = {"__metadata__": torch.ones(2), "w": torch.zeros(1)}
        _refused_and_not_committed(fmt, value, ValueError, r"'item\.__metadata__'.*reserves.*Rename", tmp_path)


def test_safetensors_keeps_metadata_as_a_dict_name_above_a_leaf(tmp_path: Path) -> None:
    """Only the exact flattened name is reserved: a subtree called `__metadata__` stores `__metadata__.x`."""
    value = {"__metadata__": {"x": torch.arange(3.0)}}
    into = {"__metadata__": {"x": torch.zeros(3)}}
    out = _round_trip(SafetensorsSerialization(), value, MemoryStorageConfig(), "/ck", into)
    assert torch.equal(out["__metadata__"]["x"], torch.arange(3.0))


def _every_dtype() -> list[torch.dtype]:
    """Every torch dtype a tensor of three zeros can be made of."""
    found: dict[str, torch.dtype] = {}
    for name in dir(torch):
        dtype = getattr(torch, name)
        if isinstance(dtype, torch.dtype) and str(dtype) not in found:
            try:
                torch.zeros(3, dtype=dtype)
            except (RuntimeError, TypeError, NotImplementedError):
                continue
            found[str(dtype)] = dtype
    return sorted(found.values(), key=str)


@pytest.mark.parametrize("dtype", _every_dtype(), ids=str)
def test_every_dtype_safetensors_accepts_loads_back_from_bytes_and_from_files(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    """A dtype the library writes but reads back as nothing (float8_e8m0fnu and float4_e2m1fn_x2 with
    safetensors 0.8) was committed and then failed the load (`KeyError: 'F8_E8M0'` from an object store's
    bytes, an unknown dtype for block reads). The save takes a dtype only if every read path gives it back."""
    value = {"a": {"b": torch.zeros(3, dtype=dtype)}}
    for storage in _storages(tmp_path):
        where = str(tmp_path / type(storage).__name__)
        try:
            out = _round_trip(SafetensorsSerialization(), value, storage, where)
        except ValueError as exc:
            assert "'item.a.b'" in str(exc) and "TorchSerialization" in str(exc), exc
            continue
        assert out["a.b"].dtype == dtype and out["a.b"].shape == (3,)
        assert _bytes(out["a.b"]) == _bytes(value["a"]["b"])


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.uint16], ids=str)
def test_a_resharded_safetensors_item_loads_back_every_dtype_its_save_accepts(
    mesh: Any, tmp_path: Path, dtype: torch.dtype
) -> None:
    """The resharding load reads blocks through the engine's own dtype table: a dtype missing from it
    (float8_e8m0fnu) must be refused by the save, not found unreadable by the load. (`from_local`: gloo
    cannot scatter float8_e8m0fnu.)"""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    layout = LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization())
    config.items = {"model": ItemSpec(layout=layout, resharder=DTensorResharder())}
    manager = CheckpointManager(config)
    make: Callable[[float, Any], Any] = lambda v, p: DTensor.from_local(torch.full((4,), v).to(dtype), mesh, [p])  # noqa: E731
    try:
        try:
            manager.save(str(tmp_path / "ck"), {"model": {"w": make(1.0, Shard(0))}})
        except ValueError as exc:
            assert "'model.w'" in str(exc), exc
            return
        into = {"w": make(0.0, Replicate())}
        out = manager.load(str(tmp_path / "ck"), into={"model": into})["model"]
        assert out["w"].dtype == dtype and _bytes(out["w"].to_local()) == _bytes(torch.ones(4).to(dtype))
    finally:
        manager.close()


def test_float8_e8m0fnu_is_refused_by_safetensors_and_kept_by_torch_files(tmp_path: Path) -> None:
    """The refusal names the fix, and the fix works: a Torch file holds the dtype."""
    value = {"scale": torch.ones(4).to(torch.float8_e8m0fnu)}
    match = r"'item\.scale'.*float8_e8m0fnu.*TorchSerialization"
    _refused_and_not_committed(SafetensorsSerialization(), value, ValueError, match, tmp_path)
    out = _round_trip(TorchSerialization(), value, MemoryStorageConfig(), "/ck")
    assert out["scale"].dtype == torch.float8_e8m0fnu and _bytes(out["scale"]) == _bytes(value["scale"])


# --------------------------------------------------------------------------------------------- json


def _nested(depth: int) -> Any:
    """`depth` lists, one inside the other."""
    return functools.reduce(lambda inner, _: [inner], range(depth - 1), [])


def _at_stack_depth(frames: int, fn: Callable[[], Any]) -> Any:
    return fn() if frames == 0 else _at_stack_depth(frames - 1, fn)


def test_json_deepest_accepted_value_loads_back_even_from_a_deep_stack() -> None:
    """The bound sits where a load, called from well inside a program, still reads the file."""
    value = {"cfg": _nested(JSON_MAX_DEPTH - 1)}
    manager = _manager(JsonSerialization(), MemoryStorageConfig())
    try:
        manager.save("/ck", {"item": value})
        out = _at_stack_depth(200, lambda: manager.load("/ck", into={"item": None})["item"])
    finally:
        manager.close()
    assert out == value


@pytest.mark.parametrize("depth", [JSON_MAX_DEPTH + 1, 5_000])
def test_json_refuses_nesting_deeper_than_it_reads_back(depth: int, tmp_path: Path) -> None:
    """A bare RecursionError failed the save before (5000 levels), or a near-limit value was written that a
    load from a deeper stack could not read."""
    match = rf"item 'item'.*nested more than {JSON_MAX_DEPTH} levels.*TorchSerialization"
    _refused_and_not_committed(JsonSerialization(), {"cfg": _nested(depth)}, ValueError, match, tmp_path)


def test_json_refuses_a_value_that_contains_itself(tmp_path: Path) -> None:
    loop: dict[str, Any] = {"a": 1}
    loop["self"] = loop
    _refused_and_not_committed(JsonSerialization(), loop, ValueError, r"'item::self' contains itself", tmp_path)


def test_json_refuses_an_int_too_long_for_a_loader_naming_its_path(tmp_path: Path) -> None:
    """`json.dumps` raised "Exceeds the limit (4300 digits)" with no word of the item or the path."""
    value = {"ok": 2**100, "seeds": [1, 10**5000]}
    _refused_and_not_committed(JsonSerialization(), value, ValueError, r"'item::seeds\.1'.*Store it as a str", tmp_path)


def test_json_keeps_ints_beyond_int64_nan_and_infinities() -> None:
    """The neighbours of the refusals still round-trip: Python's JSON has no int width, and NaN/inf survive."""
    value = {"big": 2**200, "neg": -(2**70), "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf")}
    out = _round_trip(JsonSerialization(), value, MemoryStorageConfig(), "/ck")
    assert out["big"] == 2**200 and out["neg"] == -(2**70) and out["nan"] != out["nan"]
    assert out["inf"] == float("inf") and out["ninf"] == float("-inf")


# --------------------------------------------------------------------------------------------- torch


@pytest.mark.parametrize("dtype", [torch.uint1, torch.int4], ids=str)
def test_torch_refuses_a_dtype_torch_save_cannot_name_naming_the_path(dtype: torch.dtype, tmp_path: Path) -> None:
    """`torch.save` of a uint1..7/int1..7 tensor raised a bare `KeyError: 'dtype torch.uint1 is not
    recognized'` that named neither the item nor the tensor."""
    value = {"ok": torch.ones(2), "q": {"packed": torch.zeros(4, dtype=dtype)}}
    match = rf"'item::q\.packed' \(a Tensor of dtype {dtype}\).*not recognized"
    _refused_and_not_committed(TorchSerialization(), value, pickle.PicklingError, match, tmp_path)


# --------------------------------------------------------------------------------------------- templates

_ONE, _ZERO = torch.ones(2), torch.zeros(2)
_MISFITS = [
    pytest.param({"x": _ONE}, _ZERO, id="file-dict-template-tensor"),
    pytest.param([_ONE, _ONE], _ZERO, id="file-list-template-tensor"),
    pytest.param(_ONE, {"x": _ZERO}, id="file-tensor-template-dict"),
    pytest.param(_ONE, [_ZERO], id="file-tensor-template-list"),
    pytest.param({"l": [{"x": _ONE}]}, {"l": [_ZERO]}, id="under-a-list-file-dict-template-tensor"),
    pytest.param({"l": [_ONE]}, {"l": [[_ZERO]]}, id="under-a-list-file-tensor-template-list"),
]


@pytest.mark.parametrize(("saved", "into"), _MISFITS)
@pytest.mark.parametrize("fmt", [TorchSerialization(), SafetensorsSerialization()], ids=lambda f: type(f).__name__)
def test_a_container_never_merges_with_a_leaf_in_either_tensor_format(
    fmt: SerializationFormat, saved: Any, into: Any
) -> None:
    """A safetensors file whose container met a template tensor (or the other way round) came back as None
    or as the template's own values, the file's tensors dropped without a word, where a Torch file of the
    same value is refused naming the path."""
    with pytest.raises(TemplateMismatchError, match="item 'item'"):
        _round_trip(fmt, saved, MemoryStorageConfig(), "/ck", into)


@pytest.mark.parametrize("fmt", [TorchSerialization(), SafetensorsSerialization()], ids=lambda f: type(f).__name__)
def test_a_list_running_past_the_template_comes_back_whole_in_either_tensor_format(fmt: SerializationFormat) -> None:
    """The template's list gains the stored entries past its end; safetensors gave them back as a top-level
    'a.1' key beside a one-entry list instead."""
    saved = {"a": [torch.full((2,), 1.0), {"w": torch.full((2,), 2.0)}]}
    into = {"a": [torch.zeros(2)]}
    out = _round_trip(fmt, saved, MemoryStorageConfig(), "/ck", into)
    assert list(out) == ["a"] and len(out["a"]) == 2
    assert torch.equal(out["a"][0], saved["a"][0]) and torch.equal(out["a"][1]["w"], saved["a"][1]["w"])


# --------------------------------------------------------------------------------------------- meta, depth


@pytest.mark.parametrize("fmt", [TorchSerialization(), SafetensorsSerialization()], ids=lambda f: type(f).__name__)
def test_a_meta_tensor_is_refused_by_both_tensor_formats_naming_its_path(
    fmt: SerializationFormat, tmp_path: Path
) -> None:
    """A meta tensor has no values: a Torch file of it was committed, restored nothing, and loading it into a
    real template failed with a bare "Cannot copy out of meta tensor"."""
    value = {"layers": [{"w": torch.ones(2)}, {"w": torch.empty(3, 4, device="meta")}]}
    _refused_and_not_committed(fmt, value, ValueError, r"'item(::|\.)layers\.1\.w'.*meta tensor", tmp_path)


@pytest.mark.parametrize("fmt", [TorchSerialization(), SafetensorsSerialization()], ids=lambda f: type(f).__name__)
def test_nesting_too_deep_to_encode_is_a_value_error_naming_the_item(fmt: SerializationFormat, tmp_path: Path) -> None:
    """torch.save's pickler and the safetensors flattening recurse per level: a bare RecursionError before."""
    value = {"deep": functools.reduce(lambda inner, _: [inner], range(2_000), [torch.ones(1)])}
    _refused_and_not_committed(fmt, value, ValueError, r"(?i)item 'item'.*nested deeper.*Flatten", tmp_path)


def test_two_template_paths_for_one_safetensors_name_are_refused() -> None:
    """`{"a": {"b": ...}, "a.b": ...}` both flatten to 'a.b': the one stored tensor was copied into both
    template slots, one of them with values that were never saved under it."""
    into = {"a": {"b": torch.zeros(2)}, "a.b": torch.zeros(2)}
    with pytest.raises(TemplateMismatchError, match=r"same safetensors name 'a\.b'"):
        _round_trip(SafetensorsSerialization(), {"a": {"b": torch.ones(2)}}, MemoryStorageConfig(), "/ck", into)
    assert not into["a"]["b"].any() and not into["a.b"].any()  # refused before anything was copied


def _async_manager() -> CheckpointManager:
    def spec(name: str, fmt: SerializationFormat) -> ItemSpec:
        return ItemSpec(layout=LayoutInfo(name, fmt), required=False)

    items = {
        "torch": spec("t.pt", TorchSerialization()),
        "st": spec("s.safetensors", SafetensorsSerialization()),
        "json": spec("j.json", JsonSerialization()),
    }
    config = CheckpointManager.Config(items=items, save=AsyncCheckpointSaverConfig())
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(config)


def test_the_background_writer_refuses_the_same_values_naming_the_item(tmp_path: Path) -> None:
    """The async save encodes in the writer process: each refusal above reaches the caller from there, a
    ValueError naming the item, with nothing committed."""
    cases = [
        ("torch", {"w": torch.empty(2, device="meta")}, r"'torch::w'.*meta tensor"),
        ("st", {"__metadata__": torch.ones(1)}, r"'st\.__metadata__'.*reserves"),
        ("st", {"s": torch.ones(2).to(torch.float8_e8m0fnu)}, r"'st\.s'.*float8_e8m0fnu"),
        ("json", {"n": 10**5000}, r"'json::n'.*Store it as a str"),
        ("json", {"cfg": _nested(JSON_MAX_DEPTH + 1)}, r"item 'json'.*nested more than"),
    ]
    manager = _async_manager()
    try:
        for i, (key, value, match) in enumerate(cases):
            where = str(tmp_path / f"ck{i}")
            with pytest.raises(ValueError, match=match):
                manager.save(where, {key: value}).result(timeout=120)
            with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
                manager.load(where)
    finally:
        manager.close()


@pytest.mark.parametrize("fmt", [TorchSerialization(), SafetensorsSerialization()], ids=lambda f: type(f).__name__)
def test_a_value_containing_itself_is_refused_by_the_encoder_naming_the_item(fmt: SerializationFormat) -> None:
    """The encoders are reached without the save's planning walk too (the writer encodes what it is sent): the
    cycle refusal names the item, not only the path inside it."""
    import io

    from torch_checkpointing.encoding import encode

    loop: dict[str, Any] = {"w": torch.ones(1)}
    loop["self"] = loop
    with pytest.raises(ValueError, match=r"'item::self'.*contains itself"):
        encode(fmt, "item", loop, io.BytesIO())
