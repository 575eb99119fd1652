"""Asynchronous, distributed, atomic PyTorch checkpointing.

`__all__` holds what most code needs; the other names below are importable from here for code written
against the published release, which exposed them at the top level too.
"""

# ruff: noqa: F401  (the names below are re-exports)
from torch_checkpointing.barriers import Barrier, BarrierConfig, TCPStoreBarrier, TCPStoreBarrierConfig
from torch_checkpointing.builder import make_async_checkpoint_saver, make_sync_checkpoint_saver
from torch_checkpointing.checkpoint_loader import CheckpointLoader
from torch_checkpointing.checkpoint_manager import CheckpointManager
from torch_checkpointing.checkpoint_saver import AsyncCheckpointSaver, CheckpointSaver, SyncCheckpointSaver
from torch_checkpointing.checkpoint_writer import CheckpointWriter, CheckpointWriterConfig
from torch_checkpointing.config import (
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    CheckpointSaverConfig,
    SyncCheckpointSaverConfig,
)
from torch_checkpointing.distributed_metadata import (
    CheckpointMetadata,
    DistributedItemMetadata,
    DistributedMetadata,
    GlobalObjectMetadata,
    ItemMetadata,
    ShardingMetadata,
)
from torch_checkpointing.dtensor_metadata import (
    DeviceMeshSpec,
    DTensorShardingMetadata,
    ReplicateSpec,
    ShardSpec,
    StridedShardSpec,
    _PlacementSpec,
    get_device_mesh_spec,
)
from torch_checkpointing.errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    TemplateMismatchError,
    UnsafeCheckpointError,
    WriterProcessDied,
)
from torch_checkpointing.metadata_manager import DefaultMetadataManager, MetadataManager
from torch_checkpointing.resharding import LoadPlan, Resharder, ReshardingInfo
from torch_checkpointing.schema import ItemSpec
from torch_checkpointing.staging import CheckpointStager, CheckpointStagerConfig, DefaultStager
from torch_checkpointing.types import STATE_DICT, RankInfo
from torch_checkpointing.version import Version, __version__, get_version

__all__ = [
    "CheckpointManager",
    "ItemSpec",
    "__version__",
    "get_version",
    "Version",
    "CheckpointError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "TemplateMismatchError",
    "CommitError",
    "WriterProcessDied",
]
