"""Asynchronous, distributed, atomic PyTorch checkpointing."""

from torch_checkpointing.checkpoint_manager import CheckpointManager
from torch_checkpointing.schema import ItemSpec
from torch_checkpointing.version import Version, __version__, get_version

__all__ = ["CheckpointManager", "ItemSpec", "__version__", "get_version", "Version"]
