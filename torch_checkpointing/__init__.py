"""Asynchronous, distributed, atomic PyTorch checkpointing.

`__all__` says exactly what is public: the manager and its item specs, layouts and the four serialization
formats, the resharder contract and the DTensor resharder, storage, every configuration class, the errors,
the version, and the operations on committed checkpoints (discovery, retention). Importing the package
starts no process and no thread (the writer process starts with an async `CheckpointManager`).

The other names the published release exposed at the top level stay importable for old code; they are not
part of `__all__` (most are internals with a module of their own). Every name is imported on first use
(PEP 562), so importing the package, or one light module of it such as `config`, loads no torch and no
writer stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torch_checkpointing.errors import __all__ as _ERROR_NAMES
from torch_checkpointing.version import Version, __version__, get_version

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name is imported on first use
    from torch_checkpointing.checkpoint_layout import (
        JsonSerialization,
        LayoutInfo,
        RawSerialization,
        SafetensorsSerialization,
        SerializationFormat,
        TorchSerialization,
    )
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.config import (
        AsyncCheckpointSaverConfig,
        CheckpointLoaderConfig,
        CheckpointProcessConfig,
        CheckpointSaverConfig,
        CheckpointStagerConfig,
        CheckpointWriterConfig,
        SyncCheckpointSaverConfig,
    )
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.discovery import CheckpointInfo, latest_checkpoint, list_checkpoints
    from torch_checkpointing.distributed_metadata import DistributedItemMetadata, ShardingMetadata
    from torch_checkpointing.dtensor_resharder import DTensorResharder
    from torch_checkpointing.errors import (
        CheckpointError,
        CheckpointReplacedError,
        CommitError,
        CommitOutcomeUnknownError,
        ConfigError,
        ConfigTypeError,
        CorruptCheckpointError,
        ForeignManifestError,
        IncompleteCheckpointError,
        MissingItemError,
        NestingError,
        NewerCheckpointError,
        ObjectStoreError,
        RefusedPickleError,
        TemplateMismatchError,
        UndecodableFileError,
        UnsafeCheckpointError,
        WriterProcessDied,
    )
    from torch_checkpointing.resharding import Resharder
    from torch_checkpointing.retention import RetentionPolicy
    from torch_checkpointing.schema import ItemSpec
    from torch_checkpointing.storage.base_storage import Storage, StorageConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

    # isort: split
    # Importable for code written against the published release; not in `__all__` (`X as X` marks a re-export).
    from torch_checkpointing.barriers import Barrier as Barrier
    from torch_checkpointing.barriers import BarrierConfig as BarrierConfig
    from torch_checkpointing.barriers import TCPStoreBarrier as TCPStoreBarrier
    from torch_checkpointing.barriers import TCPStoreBarrierConfig as TCPStoreBarrierConfig
    from torch_checkpointing.builder import make_async_checkpoint_saver as make_async_checkpoint_saver
    from torch_checkpointing.builder import make_sync_checkpoint_saver as make_sync_checkpoint_saver
    from torch_checkpointing.checkpoint_loader import CheckpointLoader as CheckpointLoader
    from torch_checkpointing.checkpoint_saver import AsyncCheckpointSaver as AsyncCheckpointSaver
    from torch_checkpointing.checkpoint_saver import CheckpointSaver as CheckpointSaver
    from torch_checkpointing.checkpoint_saver import SyncCheckpointSaver as SyncCheckpointSaver
    from torch_checkpointing.checkpoint_writer import CheckpointWriter as CheckpointWriter
    from torch_checkpointing.distributed_metadata import CheckpointMetadata as CheckpointMetadata
    from torch_checkpointing.distributed_metadata import DistributedMetadata as DistributedMetadata
    from torch_checkpointing.distributed_metadata import GlobalObjectMetadata as GlobalObjectMetadata
    from torch_checkpointing.distributed_metadata import ItemMetadata as ItemMetadata
    from torch_checkpointing.dtensor_metadata import DeviceMeshSpec as DeviceMeshSpec
    from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata as DTensorShardingMetadata
    from torch_checkpointing.dtensor_metadata import ReplicateSpec as ReplicateSpec
    from torch_checkpointing.dtensor_metadata import ShardSpec as ShardSpec
    from torch_checkpointing.dtensor_metadata import StridedShardSpec as StridedShardSpec
    from torch_checkpointing.dtensor_metadata import _PlacementSpec as _PlacementSpec
    from torch_checkpointing.dtensor_metadata import get_device_mesh_spec as get_device_mesh_spec
    from torch_checkpointing.metadata_manager import DefaultMetadataManager as DefaultMetadataManager
    from torch_checkpointing.metadata_manager import MetadataManager as MetadataManager
    from torch_checkpointing.resharding import LoadPlan as LoadPlan
    from torch_checkpointing.resharding import ReshardingInfo as ReshardingInfo
    from torch_checkpointing.staging import CheckpointStager as CheckpointStager
    from torch_checkpointing.staging import DefaultStager as DefaultStager
    from torch_checkpointing.types import STATE_DICT as STATE_DICT
    from torch_checkpointing.types import RankInfo as RankInfo

# Which module defines each top-level name (the version names above are imported eagerly: they are cheap).
# Nothing else is imported until a name is used, so `import torch_checkpointing.config` loads no torch and no
# writer stack, and the spawned writer process loads only what `checkpoint_process` needs.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "barriers": ("Barrier", "BarrierConfig", "TCPStoreBarrier", "TCPStoreBarrierConfig"),
    "builder": ("make_async_checkpoint_saver", "make_sync_checkpoint_saver"),
    "checkpoint_layout": (
        "JsonSerialization",
        "LayoutInfo",
        "RawSerialization",
        "SafetensorsSerialization",
        "SerializationFormat",
        "TorchSerialization",
    ),
    "checkpoint_loader": ("CheckpointLoader",),
    "checkpoint_manager": ("CheckpointManager",),
    "checkpoint_saver": ("AsyncCheckpointSaver", "CheckpointSaver", "SyncCheckpointSaver"),
    "checkpoint_writer": ("CheckpointWriter",),
    "config": (
        "CheckpointProcessConfig",
        "CheckpointWriterConfig",
        "AsyncCheckpointSaverConfig",
        "CheckpointLoaderConfig",
        "CheckpointSaverConfig",
        "SyncCheckpointSaverConfig",
        "CheckpointStagerConfig",
    ),
    "default_resharder": ("DefaultResharder",),
    "discovery": ("CheckpointInfo", "latest_checkpoint", "list_checkpoints"),
    "distributed_metadata": (
        "DistributedItemMetadata",
        "ShardingMetadata",
        "CheckpointMetadata",
        "DistributedMetadata",
        "GlobalObjectMetadata",
        "ItemMetadata",
    ),
    "dtensor_metadata": (
        "DeviceMeshSpec",
        "DTensorShardingMetadata",
        "ReplicateSpec",
        "ShardSpec",
        "StridedShardSpec",
        "_PlacementSpec",
        "get_device_mesh_spec",
    ),
    "dtensor_resharder": ("DTensorResharder",),
    "errors": tuple(_ERROR_NAMES),  # the error types are cheap to import, and listed once, in errors.py
    "metadata_manager": ("DefaultMetadataManager", "MetadataManager"),
    "resharding": ("Resharder", "LoadPlan", "ReshardingInfo"),
    "retention": ("RetentionPolicy",),
    "schema": ("ItemSpec",),
    "staging": ("CheckpointStager", "DefaultStager"),
    "storage.base_storage": ("Storage", "StorageConfig"),
    "storage.filesystem": ("LocalFileSystemStorageConfig",),
    "storage.fsspec_storage": ("FsspecStorageConfig",),
    "types": ("STATE_DICT", "RankInfo"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    """Import the defining module on first use of a top-level name (PEP 562); submodules resolve as well."""
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "AsyncCheckpointSaverConfig",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointLoaderConfig",
    "CheckpointManager",
    "CheckpointProcessConfig",
    "CheckpointReplacedError",
    "CheckpointSaverConfig",
    "CheckpointStagerConfig",
    "CheckpointWriterConfig",
    "CommitError",
    "CommitOutcomeUnknownError",
    "ConfigError",
    "ConfigTypeError",
    "CorruptCheckpointError",
    "DTensorResharder",
    "DefaultResharder",
    "DistributedItemMetadata",
    "ForeignManifestError",
    "FsspecStorageConfig",
    "IncompleteCheckpointError",
    "ItemSpec",
    "JsonSerialization",
    "LayoutInfo",
    "LocalFileSystemStorageConfig",
    "MissingItemError",
    "NestingError",
    "NewerCheckpointError",
    "ObjectStoreError",
    "RawSerialization",
    "RefusedPickleError",
    "Resharder",
    "RetentionPolicy",
    "SafetensorsSerialization",
    "SerializationFormat",
    "ShardingMetadata",
    "Storage",
    "StorageConfig",
    "SyncCheckpointSaverConfig",
    "TemplateMismatchError",
    "TorchSerialization",
    "UndecodableFileError",
    "UnsafeCheckpointError",
    "Version",
    "WriterProcessDied",
    "__version__",
    "get_version",
    "latest_checkpoint",
    "list_checkpoints",
]
