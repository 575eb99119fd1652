"""Every integer argument of the public API takes any integer scalar as the int it stands for (round 31).

The records took numpy's integers, an IntEnum's member and a 0-d integer tensor as their ints since round 30,
but the API's own arguments refused them: `manager.save(path, state, step=np.int64(3))` raised ConfigTypeError
"save(step=...) must be an int", though a training loop's step is often a numpy value or a 0-d tensor. One rule
now: an integer scalar is taken and kept as its plain int; a bool (Python's, numpy's, a bool tensor) and a
one-element array or tensor are still refused.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import (
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    CheckpointProcessConfig,
    CheckpointWriterConfig,
    SyncCheckpointSaverConfig,
)
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.hf import parse_size
from torch_checkpointing.retention import RetentionPolicy
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


class _Three(enum.IntEnum):
    THREE = 3


def _fsspec(name: str) -> Callable[[Any], Any]:
    return lambda v: getattr(FsspecStorageConfig(url="memory://b", **{name: v}), name)


# (argument, build with the value -> what was kept)
_ARGUMENTS: list[tuple[str, Callable[[Any], Any]]] = [
    ("RetentionPolicy.keep_last", lambda v: RetentionPolicy(keep_last=v).keep_last),
    ("RetentionPolicy.keep_every_n_steps", lambda v: RetentionPolicy(keep_every_n_steps=v).keep_every_n_steps),
    ("RetentionPolicy.keep_best", lambda v: RetentionPolicy(keep_best=v, metric="loss").keep_best),
    ("RetentionPolicy.unowned_after_s", lambda v: RetentionPolicy(unowned_after_s=v).unowned_after_s),
    (
        "CheckpointWriterConfig.file_write_max_threads",
        lambda v: CheckpointWriterConfig(file_write_max_threads=v).file_write_max_threads,
    ),
    (
        "CheckpointProcessConfig.subprocess_init_timeout_secs",
        lambda v: CheckpointProcessConfig(subprocess_init_timeout_secs=v).subprocess_init_timeout_secs,
    ),
    (
        "CheckpointProcessConfig.subprocess_shutdown_timeout_secs",
        lambda v: CheckpointProcessConfig(subprocess_shutdown_timeout_secs=v).subprocess_shutdown_timeout_secs,
    ),
    (
        "SyncCheckpointSaverConfig.wait_timeout_secs",
        lambda v: SyncCheckpointSaverConfig(wait_timeout_secs=v).wait_timeout_secs,
    ),
    (
        "AsyncCheckpointSaverConfig.wait_timeout_secs",
        lambda v: AsyncCheckpointSaverConfig(wait_timeout_secs=v).wait_timeout_secs,
    ),
    ("FsspecStorageConfig.part_size", _fsspec("part_size")),
    ("FsspecStorageConfig.max_concurrency", _fsspec("max_concurrency")),
    ("FsspecStorageConfig.request_timeout_s", _fsspec("request_timeout_s")),
    ("export_hf(max_shard_size=...)", parse_size),
]

_INTEGERS = [np.int64(3), np.uint8(3), np.int32(3), _Three.THREE, torch.tensor(3), np.array(3)]
_NOT_INTEGERS = [np.bool_(True), torch.tensor(True), torch.tensor([3]), np.array([3])]


@pytest.mark.parametrize("value", _INTEGERS, ids=lambda v: f"{type(v).__name__}")
@pytest.mark.parametrize(("name", "build"), _ARGUMENTS, ids=[n for n, _ in _ARGUMENTS])
def test_an_integer_scalar_is_taken_as_its_int(name: str, build: Callable[[Any], Any], value: Any) -> None:
    """Defect: every one raised ConfigTypeError ("... must be an int, got 3 (int64)")."""
    kept = build(value)
    assert kept == 3
    assert type(kept) in (int, float), f"{name} kept {type(kept).__name__}"


@pytest.mark.parametrize("value", _NOT_INTEGERS, ids=["np.bool_", "bool-tensor", "1-element-tensor", "1-el-array"])
@pytest.mark.parametrize(("name", "build"), _ARGUMENTS, ids=[n for n, _ in _ARGUMENTS])
def test_a_bool_or_an_array_is_still_refused(name: str, build: Callable[[Any], Any], value: Any) -> None:
    with pytest.raises(ConfigTypeError):
        build(value)


def _manager() -> CheckpointManager:
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
    return CheckpointManager(config)


@pytest.mark.parametrize("value", _INTEGERS, ids=lambda v: f"{type(v).__name__}")
def test_save_step_takes_an_integer_scalar(tmp_path: Path, value: Any) -> None:
    """Defect: ConfigTypeError "save(step=...) must be an int (or None: the id's trailing number), got 3"."""
    with _manager() as manager:
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}}, step=value)
    (info,) = list_checkpoints(tmp_path)
    assert info.step == 3 and type(info.step) is int


@pytest.mark.parametrize("value", [np.bool_(True), torch.tensor(True), True])
def test_save_step_refuses_a_bool(tmp_path: Path, value: Any) -> None:
    with _manager() as manager, pytest.raises(ConfigTypeError, match="step"):
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}}, step=value)
    assert list_checkpoints(tmp_path) == []


@pytest.fixture(scope="module")
def _saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "ck"
    with _manager() as manager:
        manager.save(str(path), {"m": {"x": torch.ones(2)}})
    return path


@pytest.mark.parametrize("rank", [np.int64(0), torch.tensor(0), np.array(0)], ids=["int64", "tensor", "array"])
def test_iter_item_tensors_rank_takes_an_integer_scalar(_saved: Path, rank: Any) -> None:
    """Defect: `rank=torch.tensor(0)` raised ValueError "Item 'm' has no file of rank 0; ranks: [0]"."""
    from torch_checkpointing.hf import iter_item_tensors

    assert [name for name, _ in iter_item_tensors(_saved, "m", rank=rank)] == ["x"]


@pytest.mark.parametrize("rank", [False, np.bool_(False), torch.tensor(False)], ids=["bool", "np.bool_", "tensor"])
def test_iter_item_tensors_rank_refuses_a_bool(_saved: Path, rank: Any) -> None:
    """Defect: `rank=False` exported rank 0's copy (False == 0 as a dict key)."""
    from torch_checkpointing.hf import iter_item_tensors

    with pytest.raises(ConfigTypeError, match="rank"):
        list(iter_item_tensors(_saved, "m", rank=rank))


@pytest.mark.parametrize("value", _INTEGERS, ids=lambda v: f"{type(v).__name__}")
def test_save_metrics_take_an_integer_scalar(tmp_path: Path, value: Any) -> None:
    """Defect: ConfigTypeError "save(metrics=...): entry 'acc': 3 must map a str to a number"."""
    with _manager() as manager:
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}}, metrics={"acc": value})
    (info,) = list_checkpoints(tmp_path)
    assert info.metrics == {"acc": 3.0}


@pytest.mark.parametrize(("name", "build"), _ARGUMENTS, ids=[n for n, _ in _ARGUMENTS])
def test_a_meta_tensor_is_refused_as_a_config_error(name: str, build: Callable[[Any], Any]) -> None:
    """Defect: a 0-d integer tensor on the meta device (no value to read) escaped as torch's bare RuntimeError
    "Tensor.item() cannot be called on meta tensors", naming neither the argument nor the fix."""
    with pytest.raises(ConfigTypeError):
        build(torch.tensor(3, device="meta"))


def test_save_step_refuses_a_meta_tensor(tmp_path: Path) -> None:
    with _manager() as manager, pytest.raises(ConfigTypeError, match="step"):
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}}, step=torch.tensor(3, device="meta"))
    assert list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("value", [np.float32(0.5), torch.tensor(0.5)], ids=["np.float32", "float-tensor"])
def test_a_metric_that_is_no_python_number_is_refused_naming_the_fix(tmp_path: Path, value: Any) -> None:
    """Defect: "save(metrics=...): entry 'loss': np.float32(0.5) must map a str to a number": it is a number,
    and the message said neither which type is wanted nor how to get it."""
    with _manager() as manager, pytest.raises(ConfigTypeError, match=r"float\(") as caught:
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}}, metrics={"loss": value})
    assert "'loss'" in str(caught.value) and type(value).__name__ in str(caught.value)
    assert list_checkpoints(tmp_path) == []


def test_a_metric_name_that_is_no_str_is_refused_naming_it(tmp_path: Path) -> None:
    with _manager() as manager, pytest.raises(ConfigTypeError, match="name 7 .*str") as caught:
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}}, metrics={7: 0.5})
    assert "must map a str to a number" not in str(caught.value)


_HUGE = 10**400  # an int past what a float holds (math.isfinite and float() raise OverflowError)


_SECONDS = [(n, b) for n, b in _ARGUMENTS if n.endswith(("_s", "_secs"))]


@pytest.mark.parametrize(("name", "build"), _SECONDS, ids=[n for n, _ in _SECONDS])
def test_an_int_past_a_float_is_refused_naming_the_argument(name: str, build: Callable[[Any], Any]) -> None:
    """Defect: RetentionPolicy, the process timeouts and FsspecStorageConfig raised a bare OverflowError "int too
    large to convert to float" naming no argument; the saver's wait_timeout_secs was taken, and the manager's
    build raised that OverflowError."""
    with pytest.raises((ConfigTypeError, ValueError)) as caught:
        build(_HUGE)
    assert not isinstance(caught.value, OverflowError)
    assert name.split(".")[-1] in str(caught.value)


def test_a_manager_with_a_wait_past_a_float_is_refused_naming_it() -> None:
    """Defect: the config was taken, and CheckpointManager(config) raised a bare OverflowError."""
    with pytest.raises(ValueError, match="wait_timeout_secs") as caught:
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(wait_timeout_secs=_HUGE))
    assert not isinstance(caught.value, OverflowError)


@pytest.mark.parametrize("name", ["part_size", "max_concurrency"])
def test_a_count_past_what_the_os_takes_is_refused_naming_it(name: str) -> None:
    """A count is handed to reads and thread pools, which take at most sys.maxsize. Defect: 10**400 raised a bare
    OverflowError from math.isfinite (before round 31's seconds fix), then was taken, to fail at the first upload."""
    with pytest.raises(ValueError, match=rf"FsspecStorageConfig\.{name} must be at most") as caught:
        FsspecStorageConfig(url="memory://b", **{name: _HUGE})
    assert not isinstance(caught.value, OverflowError)
