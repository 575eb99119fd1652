"""Errors at the door: every configuration field and public argument refuses a bad value where it is given.

One row per field and bad value. Each must raise `ConfigError` (a `ValueError`) or, for a wrong type,
`ConfigTypeError` (also a `TypeError`), naming the field, at construction or at the call: never a bare
comparison `TypeError`, an `AttributeError` on the first save, or a value silently taken as truthy.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.builder import make_async_checkpoint_saver, make_sync_checkpoint_saver
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    ReplicatedLayoutInfo,
    SafetensorsSerialization,
    TorchSerialization,
    serialization_format_from_dict,
)
from torch_checkpointing.config import (
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    CheckpointProcessConfig,
    CheckpointStagerConfig,
    CheckpointWriterConfig,
    SyncCheckpointSaverConfig,
)
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import ConfigError, ConfigTypeError, TemplateMismatchError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

Row = tuple[str, Callable[[], object], type[ConfigError], str]

BAD_CONFIG: list[Row] = [
    # CheckpointWriterConfig
    (
        "writer threads str",
        lambda: CheckpointWriterConfig(file_write_max_threads="2"),
        ConfigTypeError,
        "file_write_max_threads",
    ),  # type: ignore[arg-type]
    (
        "writer threads None",
        lambda: CheckpointWriterConfig(file_write_max_threads=None),
        ConfigTypeError,
        "file_write_max_threads",
    ),  # type: ignore[arg-type]
    (
        "writer threads float",
        lambda: CheckpointWriterConfig(file_write_max_threads=1.5),
        ConfigTypeError,
        "file_write_max_threads",
    ),  # type: ignore[arg-type]
    (
        "writer threads 0",
        lambda: CheckpointWriterConfig(file_write_max_threads=0),
        ConfigError,
        "file_write_max_threads must be positive",
    ),
    # CheckpointSaverConfig (sync and async)
    ("wait str", lambda: SyncCheckpointSaverConfig(wait_timeout_secs="10"), ConfigTypeError, "wait_timeout_secs"),  # type: ignore[arg-type]
    ("wait bool", lambda: SyncCheckpointSaverConfig(wait_timeout_secs=True), ConfigTypeError, "wait_timeout_secs"),
    ("wait nan", lambda: SyncCheckpointSaverConfig(wait_timeout_secs=float("nan")), ConfigError, "wait_timeout_secs"),  # type: ignore[arg-type]
    ("wait negative", lambda: AsyncCheckpointSaverConfig(wait_timeout_secs=-1), ConfigError, "non-negative or None"),
    ("writer_config None", lambda: SyncCheckpointSaverConfig(writer_config=None), ConfigTypeError, "writer_config"),  # type: ignore[arg-type]
    ("overwrite str", lambda: SyncCheckpointSaverConfig(overwrite="no"), ConfigTypeError, "overwrite"),  # type: ignore[arg-type]
    ("staging_config None", lambda: AsyncCheckpointSaverConfig(staging_config=None), ConfigTypeError, "staging_config"),  # type: ignore[arg-type]
    ("process_config None", lambda: AsyncCheckpointSaverConfig(process_config=None), ConfigTypeError, "process_config"),  # type: ignore[arg-type]
    (
        "staging_config wrong",
        lambda: AsyncCheckpointSaverConfig(staging_config=CheckpointProcessConfig()),
        ConfigTypeError,
        "staging_config",
    ),  # type: ignore[arg-type]
    # CheckpointProcessConfig
    (
        "init timeout 0",
        lambda: CheckpointProcessConfig(subprocess_init_timeout_secs=0),
        ConfigError,
        "subprocess_init_timeout_secs",
    ),
    (
        "init timeout -1",
        lambda: CheckpointProcessConfig(subprocess_init_timeout_secs=-1),
        ConfigError,
        "subprocess_init_timeout_secs",
    ),
    (
        "init timeout str",
        lambda: CheckpointProcessConfig(subprocess_init_timeout_secs="30"),
        ConfigTypeError,
        "subprocess_init_timeout_secs",
    ),  # type: ignore[arg-type]
    (
        "shutdown None",
        lambda: CheckpointProcessConfig(subprocess_shutdown_timeout_secs=None),
        ConfigTypeError,
        "subprocess_shutdown_timeout_secs",
    ),  # type: ignore[arg-type]
    (
        "shutdown -5",
        lambda: CheckpointProcessConfig(subprocess_shutdown_timeout_secs=-5),
        ConfigError,
        "subprocess_shutdown_timeout_secs",
    ),
    (
        "thread prefix None",
        lambda: CheckpointProcessConfig(thread_name_prefix=None),
        ConfigTypeError,
        "thread_name_prefix",
    ),  # type: ignore[arg-type]
    # CheckpointStagerConfig
    ("stager shm str", lambda: CheckpointStagerConfig(use_shared_memory="no"), ConfigTypeError, "use_shared_memory"),  # type: ignore[arg-type]
    ("stager async int", lambda: CheckpointStagerConfig(use_async_staging=2), ConfigTypeError, "use_async_staging"),  # type: ignore[arg-type]
    (
        "stager pinned None",
        lambda: CheckpointStagerConfig(use_pinned_memory=None),
        ConfigTypeError,
        "use_pinned_memory",
    ),  # type: ignore[arg-type]
    ("stager dir int", lambda: CheckpointStagerConfig(staging_dir=3), ConfigTypeError, "staging_dir"),  # type: ignore[arg-type]
    ("stager dir empty", lambda: CheckpointStagerConfig(staging_dir=""), ConfigError, "staging_dir"),
    (
        "stager dir without shm",
        lambda: CheckpointStagerConfig(use_shared_memory=False, staging_dir="/tmp"),
        ConfigError,
        "use_shared_memory",
    ),
    ("stager thread None", lambda: CheckpointStagerConfig(thread_name=None), ConfigTypeError, "thread_name"),  # type: ignore[arg-type]
    # CheckpointLoaderConfig
    ("loader mmap str", lambda: CheckpointLoaderConfig(use_mmap="no"), ConfigTypeError, "use_mmap"),  # type: ignore[arg-type]
    ("loader weights_only None", lambda: CheckpointLoaderConfig(weights_only=None), ConfigTypeError, "weights_only"),  # type: ignore[arg-type]
    ("loader verify str", lambda: CheckpointLoaderConfig(verify_checksums="yes"), ConfigTypeError, "verify_checksums"),  # type: ignore[arg-type]
    (
        "loader legacy int",
        lambda: CheckpointLoaderConfig(allow_legacy_checkpoints=0),
        ConfigTypeError,
        "allow_legacy_checkpoints",
    ),  # type: ignore[arg-type]
    ("loader collective str", lambda: CheckpointLoaderConfig(collective="False"), ConfigTypeError, "collective"),  # type: ignore[arg-type]
    # Storage configs
    ("local direct str", lambda: LocalFileSystemStorageConfig(use_direct_io="no"), ConfigTypeError, "use_direct_io"),  # type: ignore[arg-type]
    ("fsspec url int", lambda: FsspecStorageConfig(url=3), ConfigTypeError, "url"),  # type: ignore[arg-type]
    ("fsspec protocol None", lambda: FsspecStorageConfig(protocol=None), ConfigTypeError, "protocol"),  # type: ignore[arg-type]
    ("fsspec options None", lambda: FsspecStorageConfig(storage_options=None), ConfigTypeError, "storage_options"),  # type: ignore[arg-type]
    ("fsspec part str", lambda: FsspecStorageConfig(part_size="16MiB"), ConfigTypeError, "part_size"),  # type: ignore[arg-type]
    ("fsspec concurrency float", lambda: FsspecStorageConfig(max_concurrency=1.5), ConfigTypeError, "max_concurrency"),  # type: ignore[arg-type]
    ("fsspec timeout str", lambda: FsspecStorageConfig(request_timeout_s="5"), ConfigTypeError, "request_timeout_s"),  # type: ignore[arg-type]
    ("fsspec concurrency 0", lambda: FsspecStorageConfig(max_concurrency=0), ConfigError, "max_concurrency"),
    ("fsspec url not url", lambda: FsspecStorageConfig(url="bucket/prefix"), ConfigError, "FsspecStorageConfig.url"),
    ("local storage None", lambda: LocalFileSystemStorage(None), ConfigError, "LocalFileSystemStorageConfig"),
    ("local storage str", lambda: LocalFileSystemStorage("/tmp"), ConfigTypeError, "LocalFileSystemStorageConfig"),  # type: ignore[arg-type]
    ("fsspec storage dict", lambda: FsspecStorage({"url": "s3://b"}), ConfigTypeError, "FsspecStorageConfig"),  # type: ignore[arg-type]
    # ItemSpec
    ("itemspec layout str", lambda: ItemSpec(layout="x.pt"), ConfigTypeError, "ItemSpec.layout"),  # type: ignore[arg-type]
    ("itemspec resharder object", lambda: ItemSpec(resharder=object()), ConfigTypeError, "ItemSpec.resharder"),  # type: ignore[arg-type]
    (
        "itemspec resharder class",
        lambda: ItemSpec(resharder=DTensorResharder),
        ConfigTypeError,
        r"pass DTensorResharder\(\)",
    ),  # type: ignore[arg-type]
    ("itemspec required None", lambda: ItemSpec(required=None), ConfigTypeError, "ItemSpec.required"),  # type: ignore[arg-type]
    ("itemspec requires_copy str", lambda: ItemSpec(requires_copy="no"), ConfigTypeError, "ItemSpec.requires_copy"),  # type: ignore[arg-type]
    # LayoutInfo and the formats
    ("layout path None", lambda: LayoutInfo(None, TorchSerialization()), ConfigTypeError, "LayoutInfo.file_path"),  # type: ignore[arg-type]
    ("layout path bytes", lambda: LayoutInfo(b"x.pt", TorchSerialization()), ConfigTypeError, "LayoutInfo.file_path"),  # type: ignore[arg-type]
    (
        "layout format class",
        lambda: LayoutInfo("x.pt", TorchSerialization),
        ConfigTypeError,
        r"pass TorchSerialization\(\)",
    ),  # type: ignore[arg-type]
    ("layout format str", lambda: LayoutInfo("x.pt", "torch"), ConfigTypeError, "serialization_format"),  # type: ignore[arg-type]
    ("replicated path None", lambda: ReplicatedLayoutInfo(None, TorchSerialization()), ConfigTypeError, "file_path"),  # type: ignore[arg-type]
    (
        "replicated with rank",
        lambda: ReplicatedLayoutInfo("m_{rank}.pt", TorchSerialization()),
        ConfigError,
        "cannot hold",
    ),
    ("json cls str", lambda: JsonSerialization(cls="mod.Cls"), ConfigTypeError, "JsonSerialization.cls"),  # type: ignore[arg-type]
    ("json cls instance", lambda: JsonSerialization(cls=3), ConfigTypeError, "JsonSerialization.cls"),  # type: ignore[arg-type]
    (
        "json from_dict missing attr",
        lambda: JsonSerialization.from_dict({"cls": "os.NoSuchClass"}),
        ConfigError,
        "NoSuchClass",
    ),
    ("json from_dict int", lambda: JsonSerialization.from_dict({"cls": 3}), ConfigTypeError, "'cls'"),
    ("safetensors metadata int", lambda: SafetensorsSerialization(metadata=3), ConfigTypeError, "metadata"),  # type: ignore[arg-type]
    (
        "format from_dict str",
        lambda: serialization_format_from_dict("TorchSerialization"),
        ConfigTypeError,
        "format dict",
    ),  # type: ignore[arg-type]
    (
        "format from_dict list type",
        lambda: serialization_format_from_dict({"type": []}),
        ConfigError,
        "Unknown SerializationFormat type",
    ),
    (
        "format from_dict unknown",
        lambda: serialization_format_from_dict({"type": "Pickle"}),
        ConfigError,
        "Unknown SerializationFormat type: Pickle",
    ),
    ("layout from_dict empty", lambda: LayoutInfo.from_dict({}), ConfigError, "file_path"),
    ("layout from_dict None", lambda: LayoutInfo.from_dict(None), ConfigError, "file_path"),  # type: ignore[arg-type]
    # The builder functions and the manager's loader (built with the manager)
    (
        "make_sync wrong config",
        lambda: make_sync_checkpoint_saver(AsyncCheckpointSaverConfig()),
        ConfigTypeError,
        "config",
    ),  # type: ignore[arg-type]
    (
        "make_sync storage str",
        lambda: make_sync_checkpoint_saver(storage_config="/tmp"),
        ConfigTypeError,
        "storage_config",
    ),  # type: ignore[arg-type]
    (
        "make_async wrong config",
        lambda: make_async_checkpoint_saver(SyncCheckpointSaverConfig()),
        ConfigTypeError,
        "config",
    ),  # type: ignore[arg-type]
    (
        "make_async init_fn str",
        lambda: make_async_checkpoint_saver(subprocess_init_fn="setup"),
        ConfigTypeError,
        "subprocess_init_fn",
    ),
    (
        "make_async init_args int",
        lambda: make_async_checkpoint_saver(subprocess_init_args=5),
        ConfigTypeError,
        "subprocess_init_args",
    ),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "build", "error", "names"), BAD_CONFIG, ids=[r[0] for r in BAD_CONFIG])
def test_a_bad_configuration_value_is_refused_at_construction_naming_the_field(
    name: str, build: Callable[[], object], error: type[ConfigError], names: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(error, match=names) as info:
            build()
    assert isinstance(info.value, ValueError)  # every ConfigError; the API's ValueError callers keep working
    if error is ConfigTypeError:
        assert isinstance(info.value, TypeError)


GOOD_CONFIG: list[tuple[str, Callable[[], object]]] = [
    ("writer defaults", CheckpointWriterConfig),
    ("wait None", lambda: SyncCheckpointSaverConfig(wait_timeout_secs=None)),
    ("wait float", lambda: SyncCheckpointSaverConfig(wait_timeout_secs=0.5)),
    ("wait 0", lambda: SyncCheckpointSaverConfig(wait_timeout_secs=0)),
    ("async defaults", AsyncCheckpointSaverConfig),
    (
        "process short",
        lambda: CheckpointProcessConfig(subprocess_init_timeout_secs=1, subprocess_shutdown_timeout_secs=0),
    ),
    ("stager pathlike", lambda: CheckpointStagerConfig(staging_dir=Path("/tmp"))),  # type: ignore[arg-type]
    ("loader verify None", lambda: CheckpointLoaderConfig(verify_checksums=None)),
    ("json dict", lambda: JsonSerialization(dict)),
    ("custom resharder duck", lambda: ItemSpec(resharder=DTensorResharder())),
    ("replicated", lambda: ReplicatedLayoutInfo("shared.json", JsonSerialization())),
    ("fsspec s3", lambda: FsspecStorageConfig(url="s3://bucket/run")),
]


@pytest.mark.parametrize(("name", "build"), GOOD_CONFIG, ids=[r[0] for r in GOOD_CONFIG])
def test_good_values_still_construct(name: str, build: Callable[[], object]) -> None:
    build()


# ------------------------------------------------------------------------ arguments of load()


def _manager(items: dict[str, ItemSpec] | None = None) -> CheckpointManager:
    """A sync manager on the local file system (no direct I/O), with `items` as its item specs."""
    return CheckpointManager(
        CheckpointManager.Config(
            items=items or {},
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


@pytest.fixture
def saved(tmp_path: Path) -> tuple[CheckpointManager, str]:
    manager = _manager()
    path = os.fspath(tmp_path / "step_1")
    manager.save(path, {"model": {"w": torch.ones(3)}})
    yield manager, path
    manager.close()


BAD_LOAD_ARGS: list[tuple[str, dict[str, Any], str]] = [
    ("strict str", {"strict": "no"}, "strict"),
    ("strict None", {"strict": None}, "strict"),
    ("map_location float", {"map_location": 3.5}, "map_location"),
    ("map_location list", {"map_location": ["cpu"]}, "map_location"),
]


@pytest.mark.parametrize(("name", "kwargs", "names"), BAD_LOAD_ARGS, ids=[r[0] for r in BAD_LOAD_ARGS])
def test_a_bad_load_argument_is_refused_at_the_call_and_nothing_is_changed(
    saved: tuple[CheckpointManager, str], name: str, kwargs: dict[str, Any], names: str
) -> None:
    manager, path = saved
    template = {"w": torch.zeros(3)}
    with pytest.raises(ConfigTypeError, match=names):
        manager.load(path, {"model": template}, **kwargs)
    assert torch.equal(template["w"], torch.zeros(3))
    assert torch.equal(manager.load(path, {"model": template})["model"]["w"], torch.ones(3))  # still usable


def test_a_bad_key_or_payload_is_a_config_error(saved: tuple[CheckpointManager, str]) -> None:
    """The schema's refusals (ValueError/TypeError, as the API says) are the project's ConfigError kinds too."""
    manager, path = saved
    with pytest.raises(ConfigError, match="Invalid checkpoint keys"):
        manager.save(path + "_b", {"a.b": 1})
    with pytest.raises(ConfigTypeError, match="keys must be str"):
        manager.save(path + "_c", {1: 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigTypeError, match="must be a Mapping"):
        manager.save(path + "_d", None)  # type: ignore[arg-type]
    assert not os.path.exists(path + "_b") and not os.path.exists(path + "_c")


@pytest.mark.parametrize("file_path", ["", "/abs/m.pt", "../m.pt", "manifest.json"])
def test_a_bad_layout_path_is_a_config_error_naming_the_key(tmp_path: Path, file_path: str) -> None:
    manager = _manager({"m": ItemSpec(layout=LayoutInfo(file_path, TorchSerialization()))})
    try:
        with pytest.raises(ConfigError, match="'m'"):
            manager.save(os.fspath(tmp_path / "c"), {"m": 1})
    finally:
        manager.close()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------ a resharder's own results


class _ReturnsThis(DTensorResharder):
    """A resharder whose extract_sharding_metadata returns a fixed, wrong, value."""

    def __init__(self, result: object) -> None:
        self.result = result

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> Any:
        if self.result is _REAL:
            return super().extract_sharding_metadata(item_key, item_value)
        return self.result


_REAL = object()


@pytest.mark.parametrize(
    ("result", "names"),
    [([1, 2], "returned list"), ("meta", "returned str"), ({"w": 1}, "entry 'w'"), ({("w",): None}, "NoneType")],
    ids=["list", "str", "str key", "None value"],
)
def test_a_resharder_returning_the_wrong_metadata_is_named_by_the_save(
    tmp_path: Path, result: object, names: str
) -> None:
    """Before: an AttributeError ('list' object has no attribute 'items', ... no attribute '_pack')."""
    manager = _manager({"model": ItemSpec(resharder=_ReturnsThis(result))})
    try:
        with pytest.raises(ConfigTypeError, match=rf"_ReturnsThis.extract_sharding_metadata for item 'model'.*{names}"):
            manager.save(os.fspath(tmp_path / "c"), {"model": {"w": torch.ones(2)}})
        assert list(tmp_path.iterdir()) == []
    finally:
        manager.close()


@pytest.mark.filterwarnings("ignore:Item 'model' has plain")
@pytest.mark.parametrize(
    ("result", "names"), [([1, 2], "returned list"), ({"w": 1}, "entry 'w'")], ids=["list", "str key"]
)
def test_a_resharder_returning_the_wrong_target_metadata_is_named_by_the_load(
    tmp_path: Path, result: object, names: str
) -> None:
    """The load extracts its target metadata itself (not through the metadata manager): the same check."""
    resharder = _ReturnsThis(_REAL)
    manager = _manager({"model": ItemSpec(resharder=resharder)})
    try:
        manager.save(os.fspath(tmp_path / "c"), {"model": {"w": torch.ones(2)}})
        resharder.result = result
        template = {"w": torch.zeros(2)}
        with pytest.raises(ConfigTypeError, match=rf"_ReturnsThis.extract_sharding_metadata for item 'model'.*{names}"):
            manager.load(os.fspath(tmp_path / "c"), {"model": template})
        assert torch.equal(template["w"], torch.zeros(2))
    finally:
        manager.close()


class _LoadReturns(DTensorResharder):
    """Copies the saved tensor in whole, then returns `result` from `load` (a custom resharder's own load)."""

    def __init__(self, result: object) -> None:
        self.result = result

    def should_reshard(self, source_metadata: Any, target_metadata: Any) -> bool:
        return source_metadata is not None

    def load(
        self, source_path: Path, item_key: str, target_metadata: Any, source_metadata: Any, target: Any, storage: Any
    ) -> Any:
        import io

        data = storage.read(source_metadata.get_file_path(0, source_path, item_key))
        target["w"].copy_(torch.load(io.BytesIO(data), weights_only=True)["w"])
        return self.result


@pytest.mark.filterwarnings("ignore:Item 'model' has plain")
@pytest.mark.parametrize("result", [None, ["model.w"], "w"], ids=["None", "str paths", "str"])
def test_a_resharder_load_returning_the_wrong_result_is_named(tmp_path: Path, result: object) -> None:
    """Before: None failed as "'NoneType' object is not iterable"; str paths were split into characters and
    dropped as missing (strict=False) without a word."""
    manager = _manager({"model": ItemSpec(resharder=_LoadReturns(result))})
    try:
        manager.save(os.fspath(tmp_path / "c"), {"model": {"w": torch.ones(2)}})
        with pytest.raises(ConfigTypeError, match=r"_LoadReturns.load for item 'model' returned"):
            manager.load(os.fspath(tmp_path / "c"), {"model": {"w": torch.zeros(2)}})
    finally:
        manager.close()
    manager = _manager({"model": ItemSpec(resharder=_LoadReturns([("w",)]))})
    try:  # the right result still loads, and its paths count as missing for strict=True
        got = manager.load(os.fspath(tmp_path / "c"), {"model": {"w": torch.zeros(2)}})
        assert torch.equal(got["model"]["w"], torch.ones(2))
        with pytest.raises(TemplateMismatchError, match=r"model::w"):
            manager.load(os.fspath(tmp_path / "c"), {"model": {"w": torch.zeros(2)}}, strict=True)
    finally:
        manager.close()
