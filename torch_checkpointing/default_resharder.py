"""The DTensor resharder under the name the upstream project moved to (`DefaultResharder`)."""

from __future__ import annotations

from torch_checkpointing.dtensor_resharder import DTensorResharder, compute_local_shard_info

DefaultResharder = DTensorResharder

__all__ = ["DTensorResharder", "DefaultResharder", "compute_local_shard_info"]
