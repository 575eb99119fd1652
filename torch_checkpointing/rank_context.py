"""Rank identity and the checkpointer's own coordination channel.

Checkpoint coordination never rides on the training's process group: collectives go over a gloo group created
for the manager, and commits go over a TCPStore hosted by rank 0's trainer process, so a save in flight can
neither deadlock nor slow an NCCL all-reduce.
"""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torch_checkpointing.agreement import GroupTransport
from torch_checkpointing.config import MAX_OS_WAIT_S
from torch_checkpointing.store_channel import StoreAddress, StoreRollCall, let_go_of_host
from torch_checkpointing.types import RankInfo

__all__ = ["RankContext", "current_rank_info"]

logger = logging.getLogger("torch_checkpointing.rank_context")


def current_rank_info() -> RankInfo:
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return RankInfo(rank, world, rank, world)
    return RankInfo.single()


class RankContext:
    """Everything a manager needs to talk to its peers; trivial on a single rank."""

    def __init__(self, timeout_s: float, store_host: str | None = None, store_port: int | None = None) -> None:
        """`timeout_s`: save.wait_timeout_secs (its default where None). Past `MAX_OS_WAIT_S` (math.inf for
        'never', 1e12), as long as torch's store and gloo group can wait: handed to them as it was, inf and 1e300
        raised a bare OverflowError here, and 1e12 overflowed their millisecond clocks, so every save failed at
        once saying rank 0 was lost."""
        self.rank_info = current_rank_info()
        self.timeout_s = min(timeout_s, MAX_OS_WAIT_S)
        timeout_s = self.timeout_s
        self.group: Any = None
        self._host_store: Any = None
        self.store_address: StoreAddress | None = None
        self._roll_call: StoreRollCall | None = None
        self.uid = uuid.uuid4().hex[:12]
        if self.world_size == 1:
            return
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        host = store_host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        if self.rank == 0:
            self._host_store = dist.TCPStore(  # type: ignore[attr-defined]
                host, store_port or 0, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
            )
            shared: list[Any] = [(host, self._host_store.port, self.uid)]
        else:
            shared = [None]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        host, port, self.uid = shared[0]
        self.store_address = StoreAddress(host, port, f"torch_checkpointing/{self.uid}")
        self._roll_call = StoreRollCall(self.rank, self.world_size, self.store_address, timeout_s, self._host_store)

    @property
    def rank(self) -> int:
        return self.rank_info.global_rank

    @property
    def world_size(self) -> int:
        return self.rank_info.global_world_size

    @property
    def transport(self) -> GroupTransport:
        """The manager's gloo group as an agreement transport (see `agreement.agree`)."""
        return GroupTransport(self.rank, self.world_size, self.group, self._roll_call)

    def close(self) -> None:
        if self.group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except (ValueError, RuntimeError) as exc:  # the group is dropped either way
                logger.debug("Destroying the manager's process group failed: %r", exc)
            self.group = None
        if self.store_address is not None:
            let_go_of_host(self.store_address)
        self._host_store = None
        self._roll_call = None
