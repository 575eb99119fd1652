"""Item keys, the strict schema, and `required`: checked on save and on load, before anything is written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.memory_storage import MemoryStorageConfig
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.schema import RANK_PLACEHOLDER, resolve

KEY_RE = re.compile(r"[a-zA-Z0-9_-]+")
VALID_CHARS = "abcxyzABCXYZ0189_-"


def _manager(config: MemoryStorageConfig, **kwargs) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config, **kwargs)
    )


def test_rank_placeholder_constant() -> None:
    assert RANK_PLACEHOLDER == "{rank}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.one_of(st.text(min_size=0, max_size=12), st.text(alphabet=VALID_CHARS, min_size=1, max_size=12)))
def test_key_rule_is_a_full_match_on_save_and_load(key: str) -> None:
    config = MemoryStorageConfig()
    manager = _manager(config)
    try:
        valid = KEY_RE.fullmatch(key) is not None
        if valid:
            manager.save("/ck", {key: 1})
            assert manager.load("/ck", into={key: None}) == {key: 1}
            assert f"/ck/{key}_0.pt" in config.store.files
        else:
            with pytest.raises(ValueError, match="Invalid checkpoint keys") as info:
                manager.save("/ck", {key: 1})
            assert repr(key) in str(info.value)
            assert not any(op in ("write", "mkdir") for op, _ in config.store.calls), "refused save touched storage"
            with pytest.raises(ValueError, match="Invalid checkpoint keys"):
                manager.load("/ck", into={key: None})
    finally:
        manager.close()


@pytest.mark.parametrize("key", ["abc\n", "model.weights", "a/b", "a b", "", "ü", "x\r", "\nabc", "../x", "k$"])
def test_invalid_keys_are_rejected_with_the_rule(key: str) -> None:
    manager = _manager(MemoryStorageConfig())
    try:
        with pytest.raises(ValueError) as info:
            manager.save("/ck", {"fine": 1, key: 2})
        message = str(info.value)
        assert repr(key) in message
        assert "alphanumeric" in message and "hyphens" in message and "underscores" in message
    finally:
        manager.close()


def test_trailing_newline_key_creates_no_file(tmp_path: Path) -> None:
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    try:
        with pytest.raises(ValueError):
            manager.save(str(tmp_path / "c"), {"abc\n": torch.ones(1)})
    finally:
        manager.close()
    assert not (tmp_path / "c").exists()


def test_non_str_key_is_a_type_error() -> None:
    manager = _manager(MemoryStorageConfig())
    try:
        with pytest.raises(TypeError, match="str"):
            manager.save("/ck", {1: "x"})  # type: ignore[dict-item]
    finally:
        manager.close()


def test_invalid_key_in_config_items_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="model.pt"):
        _manager(MemoryStorageConfig(), items={"model.pt": ItemSpec()})


def test_strict_schema_rejects_unlisted_keys_all_at_once() -> None:
    config = MemoryStorageConfig()
    manager = _manager(config, items={"model": ItemSpec()}, default=None)
    try:
        with pytest.raises(KeyError) as info:
            manager.save("/ck", {"model": 1, "zeta": 2, "alpha": 3})
        message = str(info.value)
        assert "['alpha', 'zeta']" in message and "strict" in message
        assert not config.store.files
        with pytest.raises(KeyError, match="alpha"):
            manager.load("/ck", into={"model": None, "alpha": None})
        manager.save("/ck", {"model": 1})
        assert manager.load("/ck", into={"model": None}) == {"model": 1}
    finally:
        manager.close()


def test_default_spec_applies_to_unlisted_keys() -> None:
    config = MemoryStorageConfig()
    manager = _manager(config, items={"a": ItemSpec()})
    try:
        manager.save("/ck", {"a": 1, "b": 2})
        assert {"/ck/a_0.pt", "/ck/b_0.pt"} <= set(config.store.files)
    finally:
        manager.close()


def test_required_items_missing_from_payload_raise() -> None:
    config = MemoryStorageConfig()
    manager = _manager(config, items={"model": ItemSpec(), "optim": ItemSpec(), "opt_in": ItemSpec(required=False)})
    try:
        with pytest.raises(KeyError) as info:
            manager.save("/ck", {"other": 1})
        assert "['model', 'optim']" in str(info.value)
        assert "opt_in" not in str(info.value)
        assert not config.store.files
    finally:
        manager.close()


def test_required_item_missing_from_checkpoint_raises_naming_it() -> None:
    config = MemoryStorageConfig()
    writer = _manager(config)
    reader = _manager(config, items={"model": ItemSpec(), "extra": ItemSpec()})
    try:
        writer.save("/ck", {"model": 1})
        with pytest.raises(RuntimeError, match="extra"):
            reader.load("/ck")
    finally:
        writer.close()
        reader.close()


def test_optional_item_may_be_absent_from_payload_and_checkpoint() -> None:
    config = MemoryStorageConfig()
    manager = _manager(config, items={"model": ItemSpec(), "ema": ItemSpec(required=False)})
    try:
        manager.save("/ck", {"model": torch.ones(2)})
        assert "/ck/ema_0.pt" not in config.store.files
        out = manager.load("/ck")
        assert set(out) == {"model"}
        out = manager.load("/ck", into={"model": None, "ema": None}, strict=True)
        assert set(out) == {"model"}
        manager.save("/ck2", {"model": torch.ones(2), "ema": torch.zeros(2)})
        assert torch.equal(manager.load("/ck2")["ema"], torch.zeros(2))
    finally:
        manager.close()


def test_default_required_has_no_effect_on_unlisted_keys() -> None:
    items = resolve({"a": 1}, {}, ItemSpec(required=True), 0)
    assert [i.key for i in items] == ["a"]


@settings(max_examples=60, deadline=None)
@given(
    listed=st.dictionaries(st.text(VALID_CHARS, min_size=1, max_size=5), st.booleans(), max_size=4),
    payload=st.sets(st.text(VALID_CHARS, min_size=1, max_size=5), max_size=4),
    strict=st.booleans(),
)
def test_resolution_property(listed: dict[str, bool], payload: set[str], strict: bool) -> None:
    """Resolution accepts a payload iff every required key is there and (strict) every key is listed."""
    items = {k: ItemSpec(required=r) for k, r in listed.items()}
    missing = {k for k, r in listed.items() if r and k not in payload}
    unknown = {k for k in payload if k not in listed} if strict else set()
    values = {k: k for k in payload}
    if missing or unknown:
        with pytest.raises(KeyError) as info:
            resolve(values, items, None if strict else ItemSpec(), 0)
        reported = missing or unknown
        assert all(repr(k) in str(info.value) for k in reported)
    else:
        resolved = resolve(values, items, None if strict else ItemSpec(), 0)
        assert {i.key: i.value for i in resolved} == values
        for item in resolved:
            assert item.spec == items.get(item.key, ItemSpec())
