"""`LayoutInfo`: `{rank}` expansion, the default layout, custom paths, and paths refused before any write."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.memory_storage import MemoryStorageConfig, files_under
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
    SerializationFormat,
    TorchSerialization,
    default_layout_info,
    serialization_format_from_dict,
)
from torch_checkpointing.config import SyncCheckpointSaverConfig


def _manager(items: dict[str, ItemSpec], storage: Any = None) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), storage_config=storage)
    )


def test_layout_info_fields_and_frozen() -> None:
    layout = LayoutInfo("model_{rank}.pt", TorchSerialization())
    assert [f.name for f in dataclasses.fields(LayoutInfo)] == ["file_path", "serialization_format"]
    assert layout == LayoutInfo(file_path="model_{rank}.pt", serialization_format=TorchSerialization())
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.file_path = "x"  # type: ignore[misc]


def test_default_layout_info() -> None:
    assert default_layout_info("model_state", 3) == LayoutInfo("model_state_3.pt", TorchSerialization())


def test_default_layout_writes_key_rank_pt_with_torch_save(tmp_path: Path) -> None:
    manager = _manager({})
    try:
        state = {"w": torch.arange(6.0).reshape(2, 3), "meta": {"lr": 0.1}}
        manager.save(str(tmp_path / "c"), {"model_state": state, "step": 9})
    finally:
        manager.close()
    assert files_under(tmp_path / "c") == {"model_state_0.pt", "step_0.pt", "manifest.json"}
    loaded = torch.load(tmp_path / "c" / "model_state_0.pt", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["meta"] == {"lr": 0.1}
    assert torch.load(tmp_path / "c" / "step_0.pt", weights_only=True) == 9


@pytest.mark.parametrize(
    ("file_path", "expected"),
    [
        ("model_{rank}.pt", "model_0.pt"),
        ("rank_{rank}/model.pt", "rank_0/model.pt"),
        ("model.pt", "model.pt"),
        ("raw_{key}_{rank}.bin", "raw_{key}_0.bin"),
        ("{rank}/{rank}-{step}.pt", "0/0-{step}.pt"),
        ("a/b/c/deep_{rank}.pt", "a/b/c/deep_0.pt"),
        ("{{rank}}.pt", "{0}.pt"),
    ],
)
def test_rank_is_the_only_placeholder(tmp_path: Path, file_path: str, expected: str) -> None:
    manager = _manager({"item": ItemSpec(layout=LayoutInfo(file_path, TorchSerialization()))})
    try:
        manager.save(str(tmp_path / "c"), {"item": torch.ones(2)})
        assert files_under(tmp_path / "c") == {expected, "manifest.json"}
        assert torch.equal(manager.load(str(tmp_path / "c"), into={"item": None})["item"], torch.ones(2))
    finally:
        manager.close()


def test_rank_placeholder_uses_global_rank() -> None:
    assert LayoutInfo("m_{rank}/{rank}.pt", TorchSerialization()).for_rank(3).file_path == "m_3/3.pt"


@settings(max_examples=80, deadline=None)
@given(
    parts=st.lists(
        st.text(alphabet="abc_-{}.xyz0123", min_size=1, max_size=6).filter(lambda s: s not in (".", "..")),
        min_size=1,
        max_size=3,
    )
)
def test_any_relative_path_round_trips(parts: list[str]) -> None:
    file_path = "/".join(parts)
    expected = file_path.replace("{rank}", "0")
    if expected in ("manifest.json", "metadata.json", ".incomplete"):
        return
    storage = MemoryStorageConfig()
    manager = _manager({"item": ItemSpec(layout=LayoutInfo(file_path, TorchSerialization()))}, storage)
    try:
        manager.save("/ck", {"item": {"v": torch.arange(3)}})
        assert f"/ck/{expected}" in storage.store.files
        out = manager.load("/ck", into={"item": {"v": torch.zeros(3, dtype=torch.int64)}})
        assert torch.equal(out["item"]["v"], torch.arange(3))
    finally:
        manager.close()


def test_custom_layouts_example_from_design_doc(tmp_path: Path) -> None:
    manager = _manager(
        {
            "model": ItemSpec(layout=LayoutInfo("model_{rank}.pt", TorchSerialization())),
            "optimizer": ItemSpec(layout=LayoutInfo("optimizer_{rank}.pt", TorchSerialization())),
            "misc_state": ItemSpec(
                requires_copy=False, layout=LayoutInfo("rank_{rank}/misc_state.json", JsonSerialization())
            ),
        }
    )
    try:
        payload = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {}}, "misc_state": {"step": 4}}
        manager.save(str(tmp_path / "c"), payload)
        assert files_under(tmp_path / "c") == {
            "model_0.pt",
            "optimizer_0.pt",
            "rank_0/misc_state.json",
            "manifest.json",
        }
        out = manager.load(str(tmp_path / "c"), into={"model": None, "optimizer": None, "misc_state": None})
        assert out["misc_state"] == {"step": 4}
    finally:
        manager.close()


@pytest.mark.parametrize(
    ("paths", "match"),
    [
        ({"a": "same.pt", "b": "same.pt"}, "same.pt"),
        ({"a": "dir/x.pt", "b": "dir/./x.pt"}, "dir/x.pt"),
        ({"a": "x_{rank}.pt", "b": "x_0.pt"}, "x_0.pt"),
        ({"a": "b_0.pt"}, "b_0.pt"),  # collides with b's default layout
    ],
)
def test_two_items_one_file_is_refused_before_writing(tmp_path: Path, paths: dict[str, str], match: str) -> None:
    items = {k: ItemSpec(layout=LayoutInfo(p, TorchSerialization())) for k, p in paths.items()}
    manager = _manager(items)
    try:
        with pytest.raises(ValueError, match=match):
            manager.save(str(tmp_path / "c"), {"a": 1, "b": 2})
    finally:
        manager.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "file_path",
    ["/abs/model.pt", "../escape.pt", "sub/../../escape.pt", "..", "", "sub/", "manifest.json"],
)
def test_bad_paths_are_refused_before_writing(tmp_path: Path, file_path: str) -> None:
    manager = _manager({"m": ItemSpec(layout=LayoutInfo(file_path, TorchSerialization()))})
    try:
        with pytest.raises(ValueError, match="'m'"):
            manager.save(str(tmp_path / "c"), {"m": 1, "other": 2})
        with pytest.raises(ValueError, match="'m'"):
            manager.load(str(tmp_path / "c"), into={"m": None})
    finally:
        manager.close()
    assert list(tmp_path.iterdir()) == []
    assert not Path("/abs/model.pt").exists()


def test_absolute_path_names_the_fix(tmp_path: Path) -> None:
    manager = _manager({"m": ItemSpec(layout=LayoutInfo("/abs/x.pt", TorchSerialization()))})
    try:
        with pytest.raises(ValueError, match="relative"):
            manager.save(str(tmp_path / "c"), {"m": 1})
    finally:
        manager.close()


class CustomFormat(SerializationFormat):
    def to_dict(self) -> dict[str, Any]:
        return {"type": "CustomFormat"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CustomFormat:
        return cls()


class TorchSubclass(TorchSerialization):
    pass


@pytest.mark.parametrize("fmt", [CustomFormat(), TorchSubclass()], ids=["custom", "subclass-of-shipped"])
def test_custom_serialization_format_is_refused(tmp_path: Path, fmt: SerializationFormat) -> None:
    manager = _manager({"m": ItemSpec(layout=LayoutInfo("m.bin", fmt))})
    try:
        with pytest.raises(ValueError) as info:
            manager.save(str(tmp_path / "c"), {"m": b"x"})
        message = str(info.value)
        assert type(fmt).__name__ in message and "'m'" in message
        assert "TorchSerialization" in message and "SafetensorsSerialization" in message
    finally:
        manager.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "fmt",
    [
        TorchSerialization(),
        JsonSerialization(),
        JsonSerialization(cls=LayoutInfo),
        RawSerialization(),
        SafetensorsSerialization(),
        SafetensorsSerialization(metadata={"a": "1"}),
    ],
)
def test_format_dict_round_trip(fmt: SerializationFormat) -> None:
    assert serialization_format_from_dict(fmt.to_dict()) == fmt
    layout = LayoutInfo("x_{rank}.bin", fmt)
    assert LayoutInfo.from_dict(layout.to_dict()) == layout


def test_unknown_format_dict_is_refused() -> None:
    with pytest.raises(ValueError, match="Unknown SerializationFormat type: Nope"):
        serialization_format_from_dict({"type": "Nope"})
