"""Barriers for multi-rank commits, over a TCPStore so that they work in processes without a process group."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torch_checkpointing.errors import CommitError
from torch_checkpointing.store_channel import StoreAddress, StoreChannel
from torch_checkpointing.types import RankInfo

__all__ = ["Barrier", "BarrierConfig", "TCPStoreBarrier", "TCPStoreBarrierConfig"]


@dataclass
class BarrierConfig(ABC):
    timeout_barrier_init_sec: int

    @abstractmethod
    def create_barrier(self, rank_info: RankInfo) -> Barrier: ...


class Barrier(ABC):
    @abstractmethod
    def __init__(self, config: BarrierConfig) -> None: ...

    @abstractmethod
    def execute_barrier(self, timeout_secs: int) -> None: ...


@dataclass
class TCPStoreBarrierConfig(BarrierConfig):
    use_checkpoint_barrier_tcpstore_libuv: bool
    tcpstore_port: int
    master_address: str
    key_prefix: str = ""

    def create_barrier(self, rank_info: RankInfo) -> TCPStoreBarrier:
        return TCPStoreBarrier(self, rank_info)


class TCPStoreBarrier(Barrier):
    """Role rank 0 hosts the store; each barrier has its own sequence number so barriers never mix."""

    def __init__(self, config: TCPStoreBarrierConfig, rank_info: RankInfo | None = None) -> None:
        self.config = config
        self.rank_info = rank_info or RankInfo.single()
        self._seq = 0
        self._host_store: Any = None  # a torch TCPStore, which torch.distributed does not export to type checkers
        if self.rank_info.role_rank == 0:
            self._host_store = dist.TCPStore(  # type: ignore[attr-defined]
                config.master_address,
                config.tcpstore_port,
                is_master=True,
                timeout=timedelta(seconds=config.timeout_barrier_init_sec),
                wait_for_workers=False,
                use_libuv=config.use_checkpoint_barrier_tcpstore_libuv,
            )
        self._channel: StoreChannel | None = None

    def _get_channel(self, timeout_secs: int) -> StoreChannel:
        """The channel of the earlier barriers, unless a call on it failed or went unanswered: its client may hold
        a half-read reply, and every later barrier failed at once on it, the host back or not.

        Its client is the barrier's own (`shared=False`), gone with the barrier: kept as the process's client of
        the host, nothing let go of it (a barrier has no close()), and each barrier host's connection stayed open
        until the process exited."""
        if self._channel is None or self._channel.spent:
            address = StoreAddress(
                self.config.master_address, self.config.tcpstore_port, f"barrier/{self.config.key_prefix}"
            )
            self._channel = StoreChannel(address, timeout_secs, store=self._host_store, shared=False)
        self._channel.timeout_s = timeout_secs
        return self._channel

    def execute_barrier(self, timeout_secs: int) -> None:
        channel = self._get_channel(timeout_secs)
        self._seq += 1
        try:
            channel.publish(f"{self._seq}/{self.rank_info.role_rank}", "arrived")
            channel.gather(
                str(self._seq),
                self.rank_info.role_world_size,
                f"arrival at barrier {self._seq}",
                during="TCPStoreBarrier",
                call="execute_barrier()",
                outcome="",
            )
        except CommitError as exc:  # a barrier that times out is a TimeoutError, as it always was
            raise TimeoutError(str(exc)) from exc
