"""Every signature and default that API_SURFACE §2 to §8 records is one user code can call as written.

Code written against the published release passes these arguments by position and by name, so each
documented parameter must keep its place, name and default. Parameters we add are allowed only after the
documented ones and only with a default (they cannot break a call). Deliberate differences listed in
docs/api_differences.md (e.g. `use_async_staging`, `subprocess_init_timeout_secs`) are not checked here.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import pytest

_NO_DEFAULT = inspect.Parameter.empty
# (module under torch_checkpointing, dotted name) -> documented parameters, in order, as (name, default).
SIGNATURES: dict[tuple[str, str], list[tuple[str, Any]]] = {
    ("checkpoint_manager", "CheckpointManager"): [("config", None)],
    ("checkpoint_manager", "CheckpointManager.save"): [
        ("self", _NO_DEFAULT),
        ("checkpoint_id", _NO_DEFAULT),
        ("checkpoint", _NO_DEFAULT),
    ],
    ("checkpoint_manager", "CheckpointManager.load"): [
        ("self", _NO_DEFAULT),
        ("checkpoint_id", _NO_DEFAULT),
        ("into", None),
        ("map_location", None),
        ("strict", False),
    ],
    ("checkpoint_manager", "CheckpointManager.prewarm_staging"): [("self", _NO_DEFAULT), ("checkpoint", _NO_DEFAULT)],
    ("checkpoint_manager", "CheckpointManager.lock"): [("self", _NO_DEFAULT)],
    ("checkpoint_manager", "CheckpointManager.close"): [("self", _NO_DEFAULT)],
    ("checkpoint_manager", "CheckpointManager.Config.build"): [("self", _NO_DEFAULT)],
    ("checkpoint_manager", "CheckpointManager.Config.with_sync_save"): [],
    ("checkpoint_manager", "CheckpointManager.Config.with_async_save"): [],
    ("schema", "ItemSpec"): [("requires_copy", True), ("layout", None), ("resharder", None), ("required", True)],
    ("checkpoint_layout", "TorchSerialization"): [],
    ("checkpoint_layout", "RawSerialization"): [],
    ("checkpoint_layout", "JsonSerialization"): [("cls", None)],
    ("checkpoint_layout", "SafetensorsSerialization"): [("metadata", None)],
    ("checkpoint_layout", "LayoutInfo"): [("file_path", _NO_DEFAULT), ("serialization_format", _NO_DEFAULT)],
    ("checkpoint_layout", "default_layout_info"): [("key", _NO_DEFAULT), ("rank", _NO_DEFAULT)],
    ("checkpoint_layout", "serialization_format_from_dict"): [("d", _NO_DEFAULT)],
    ("resharding", "LoadPlan"): [
        ("offsets", _NO_DEFAULT),
        ("sizes", _NO_DEFAULT),
        ("src_rank", _NO_DEFAULT),
        ("src_fqn", _NO_DEFAULT),
        ("src_offsets", _NO_DEFAULT),
        ("src_sizes", _NO_DEFAULT),
        ("transpose_dims", ()),
        ("src_elem_size", 0),
        ("src_dtype", ""),
    ],
    ("resharding", "Resharder.should_reshard"): [
        ("self", _NO_DEFAULT),
        ("source_metadata", _NO_DEFAULT),
        ("target_metadata", _NO_DEFAULT),
    ],
    ("dtensor_resharder", "DTensorResharder"): [],
    ("dtensor_resharder", "compute_local_shard_info"): [("metadata", _NO_DEFAULT), ("rank", _NO_DEFAULT)],
    ("distributed_metadata", "GlobalObjectMetadata"): [("sharding_metadata", _NO_DEFAULT), ("ranks", _NO_DEFAULT)],
    ("distributed_metadata", "DistributedItemMetadata"): [
        ("nested_path_to_metadata", _NO_DEFAULT),
        ("rank_to_layout_info", _NO_DEFAULT),
    ],
    ("distributed_metadata", "DistributedItemMetadata.get_file_path"): [
        ("self", _NO_DEFAULT),
        ("rank", _NO_DEFAULT),
        ("checkpoint_path", _NO_DEFAULT),
        ("item_key", _NO_DEFAULT),
    ],
    ("distributed_metadata", "load_distributed_metadata"): [("checkpoint_dir", _NO_DEFAULT), ("storage", _NO_DEFAULT)],
    ("dtensor_metadata", "ShardSpec"): [("dim", _NO_DEFAULT)],
    ("dtensor_metadata", "DeviceMeshSpec"): [
        ("device_type", _NO_DEFAULT),
        ("mesh_shape", _NO_DEFAULT),
        ("mesh_data", _NO_DEFAULT),
        ("mesh_dim_names", None),
    ],
    ("dtensor_metadata", "get_device_mesh_spec"): [
        ("device_type", _NO_DEFAULT),
        ("mesh_shape", _NO_DEFAULT),
        ("mesh_data", _NO_DEFAULT),
        ("mesh_dim_names", None),
    ],
    ("types", "RankInfo"): [
        ("global_rank", _NO_DEFAULT),
        ("global_world_size", _NO_DEFAULT),
        ("role_rank", _NO_DEFAULT),
        ("role_world_size", _NO_DEFAULT),
    ],
    ("types", "CheckpointPath"): [("item_key", _NO_DEFAULT), ("nested_path", ())],
    ("storage.base_storage", "ReadArgs"): [
        ("pre_read_full_file", True),
        ("direct_io", False),
        ("timeout_us", 900_000_000),
    ],
    ("storage.base_storage", "Storage.rename"): [
        ("self", _NO_DEFAULT),
        ("src_path", _NO_DEFAULT),
        ("dst_path", _NO_DEFAULT),
        ("is_directory", False),
        ("is_cross_link", False),
        ("background_cleanup", False),
    ],
    ("storage.base_storage", "Storage.mkdir"): [("self", _NO_DEFAULT), ("path", _NO_DEFAULT), ("recursive", True)],
    ("storage.base_storage", "Storage.stream_read"): [
        ("self", _NO_DEFAULT),
        ("path", _NO_DEFAULT),
        ("read_args", None),
    ],
    ("storage.filesystem", "LocalFileSystemStorageConfig"): [("use_direct_io", True)],
    ("config", "CheckpointLoaderConfig"): [("use_mmap", True)],
    ("checkpoint_writer", "CheckpointWriterConfig"): [
        ("checkpoint_write_barrier_timeout_sec", 600),
        ("barrier_config", None),
        ("file_write_max_threads", 1),
    ],
    ("barriers", "TCPStoreBarrierConfig"): [
        ("timeout_barrier_init_sec", _NO_DEFAULT),
        ("use_checkpoint_barrier_tcpstore_libuv", _NO_DEFAULT),
        ("tcpstore_port", _NO_DEFAULT),
        ("master_address", _NO_DEFAULT),
        ("key_prefix", ""),
    ],
    ("checkpoint_process", "CheckpointProcessConfig"): [
        ("subprocess_init_timeout_secs", 30),
        ("subprocess_shutdown_timeout_secs", 60),
        ("thread_name_prefix", "ckpt"),
    ],
}
# Defaults our engine changed on purpose (docs/api_differences.md): only the name and place are checked.
DELIBERATE_DEFAULTS = {("checkpoint_process", "CheckpointProcessConfig", "subprocess_init_timeout_secs")}

ABSTRACT: dict[tuple[str, str], set[str]] = {
    ("checkpoint_layout", "SerializationFormat"): {"to_dict", "from_dict"},
    ("resharding", "Resharder"): {"extract_sharding_metadata", "load"},
    ("distributed_metadata", "ShardingMetadata"): {"to_dict", "from_dict", "equivalent_ranks"},
}


def _resolve(module: str, dotted: str) -> Any:
    obj: Any = importlib.import_module(f"torch_checkpointing.{module}")
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("module", "dotted"), sorted(SIGNATURES), ids=lambda v: str(v))
def test_documented_parameters_keep_their_place_name_and_default(module: str, dotted: str) -> None:
    params = list(inspect.signature(_resolve(module, dotted)).parameters.values())
    expected = SIGNATURES[(module, dotted)]
    assert [p.name for p in params[: len(expected)]] == [name for name, _ in expected], params
    for param, (name, default) in zip(params, expected, strict=False):
        if (module, dotted, name) in DELIBERATE_DEFAULTS:
            continue
        assert param.default == default, f"{dotted}.{name}: default {param.default!r}, documented {default!r}"
    extra = [
        p.name
        for p in params[len(expected) :]
        if p.default is _NO_DEFAULT and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    assert not extra, f"{dotted}: parameters we added must have a default, these do not: {extra}"


@pytest.mark.parametrize(("module", "dotted"), sorted(ABSTRACT), ids=lambda v: str(v))
def test_documented_abstract_methods(module: str, dotted: str) -> None:
    assert set(_resolve(module, dotted).__abstractmethods__) == ABSTRACT[(module, dotted)]


def test_config_defaults_are_the_documented_objects() -> None:
    """§2.1: the defaults of every Config field, and the two presets."""
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointLoaderConfig, SyncCheckpointSaverConfig

    config = CheckpointManager.Config()
    assert [f.name for f in dataclasses.fields(config)][:9] == [
        "items",
        "default",
        "save",
        "load",
        "storage_config",
        "subprocess_init_fn",
        "subprocess_init_args",
        "pre_finalize_callback",
        "finalize_callback",
    ]
    assert (config.items, config.default, config.storage_config) == ({}, ItemSpec(), None)
    assert type(config.save) is AsyncCheckpointSaverConfig and type(config.load) is CheckpointLoaderConfig
    assert config.load.use_mmap is True and config.save.wait_timeout_secs == 600
    assert (config.subprocess_init_fn, config.subprocess_init_args) == (None, ())
    assert (config.pre_finalize_callback, config.finalize_callback) == (None, None)
    assert type(CheckpointManager.Config.with_sync_save().save) is SyncCheckpointSaverConfig
    assert type(CheckpointManager.Config.with_async_save().save) is AsyncCheckpointSaverConfig
    with pytest.raises(TypeError):
        CheckpointManager.Config({})  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.bogus = 1  # type: ignore[attr-defined]


def test_documented_constants() -> None:
    from torch_checkpointing import config, schema
    from torch_checkpointing.checkpoint_writer import CheckpointWriter

    assert schema.RANK_PLACEHOLDER == "{rank}"
    assert config.DEFAULT_WAIT_TIMEOUT_SECS == 600
    assert CheckpointWriter.TMP_PREFIX == "tmp_"
