"""The extension points say what the engine calls: methods it never calls are not abstract, and fields it
accepts but ignores warn (FutureWarning) instead of being dropped silently."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing.config import CheckpointWriterConfig
from torch_checkpointing.resharding import LoadPlan, Resharder
from torch_checkpointing.staging import CheckpointStager, CheckpointStagerConfig, DefaultStager
from torch_checkpointing.storage.base_storage import Storage


def _plan(**extra: Any) -> LoadPlan:
    return LoadPlan((0,), (2,), 0, "w", (0,), (2,), **extra)


def test_load_plan_transpose_dims_warns_that_it_is_ignored() -> None:
    with pytest.warns(FutureWarning, match=r"transpose_dims=\(1, 0\) \(for 'w'\) is ignored"):
        _plan(transpose_dims=(1, 0))


def test_load_plan_without_transpose_dims_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _plan().transpose_dims == () and _plan(src_dtype="float32").numel == 2


def test_keys_not_requiring_copy_warns_and_still_skips_those_items() -> None:
    stager = DefaultStager(CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False))
    source = {"copied": torch.ones(3), "kept": torch.zeros(3)}
    try:
        with pytest.warns(FutureWarning, match="keys_not_requiring_copy"):
            staged = stager.stage(source, keys_not_requiring_copy={"kept"})
        assert staged["kept"] is source["kept"]
        assert staged["copied"] is not source["copied"] and torch.equal(staged["copied"], source["copied"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stager.stage(source)  # the default: no warning
    finally:
        stager.close()


class _MinimalStorage(Storage):
    """Implements only the methods the engine calls: still instantiable."""

    def stream_read(self, path: Path, read_args: Any = None) -> io.RawIOBase:
        raise NotImplementedError

    def stream_write(self, path: Path) -> io.IOBase:
        raise NotImplementedError

    def write(self, path: Path, data: Any) -> None:
        raise NotImplementedError

    def delete(self, path: Path) -> None:
        raise NotImplementedError

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        raise NotImplementedError

    def rmdir(self, path: Path) -> None:
        raise NotImplementedError

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        is_cross_link: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        raise NotImplementedError

    def ls(self, path: Path) -> list[str]:
        return []

    def exists(self, path: Path) -> bool:
        return False

    def getsize(self, path: Path) -> int:
        raise FileNotFoundError(path)

    def isdir(self, path: Path) -> bool:
        return False


def test_storage_without_remap_path_is_a_storage() -> None:
    storage = _MinimalStorage()
    assert storage.remap_path(Path("a/b")) == "a/b"
    assert storage.glob("missing/*.pt") == []


class _MinimalStager(CheckpointStager):
    def stage(self, state_dict: Any, keys_not_requiring_copy: Any = ()) -> Any:
        return dict(state_dict)

    def close(self) -> None:
        return None


def test_stager_needs_only_stage_and_close() -> None:
    stager = _MinimalStager()
    assert stager.stage({"a": 1}) == {"a": 1} and stager.get_staged_state_dict() is None


@pytest.mark.parametrize("cls", [Storage, Resharder])
def test_docstrings_give_the_call_order(cls: type) -> None:
    assert "What the engine calls, and when" in (cls.__doc__ or "")


@pytest.mark.parametrize(
    ("build", "field_name"),
    [
        (lambda: CheckpointStagerConfig(metric_prefix="x"), "CheckpointStagerConfig.metric_prefix"),
        (lambda: CheckpointWriterConfig(barrier_config=object()), "CheckpointWriterConfig.barrier_config"),
        (
            lambda: CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=5),
            "CheckpointWriterConfig.checkpoint_write_barrier_timeout_sec",
        ),
    ],
)
def test_config_fields_the_engine_ignores_warn_when_set(build: Any, field_name: str) -> None:
    with pytest.warns(FutureWarning, match=f"{field_name} is ignored") as caught:
        build()
    assert caught[0].filename == __file__  # points at the caller's line


def test_default_configs_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
        CheckpointWriterConfig(file_write_max_threads=2)


def test_writer_args_metric_prefix_is_ignored_and_says_so() -> None:
    from torch_checkpointing.checkpoint_writer import CheckpointWriterArgs
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    from torch_checkpointing.types import RankInfo

    rank = RankInfo(0, 1, 0, 1)
    with pytest.warns(FutureWarning, match="CheckpointWriterArgs.metric_prefix is ignored"):
        CheckpointWriterArgs(CheckpointWriterConfig(), rank, LocalFileSystemStorageConfig(), metric_prefix="x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointWriterArgs(CheckpointWriterConfig(), rank, LocalFileSystemStorageConfig())
