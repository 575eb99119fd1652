"""Barriers for multi-rank commits, over a TCPStore so that they work in processes without a process group."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torch_checkpointing.agreement import describe
from torch_checkpointing.config import MAX_OS_WAIT_S, check_number
from torch_checkpointing.errors import (
    CommitError,
    CommitOutcomeUnknownError,
    ConfigError,
    add_note,
    log_safely,
)
from torch_checkpointing.store_channel import StoreAddress, StoreChannel
from torch_checkpointing.types import RankInfo

__all__ = ["Barrier", "BarrierConfig", "TCPStoreBarrier", "TCPStoreBarrierConfig"]

logger = logging.getLogger(__name__)

# A round's outcome in rank 0's store (`TCPStoreBarrier._outcome`): passed, or failed by the rank named after it.
_PASSED = "passed"
_FAILED = "failed/"
# How long a rank that leaves a round waits for rank 0's store to take its decision (a live store answers at once).
_LEAVING_WAIT_S = 3.0


def barrier_seconds(owner: str, name: str, value: object) -> Any:
    """A barrier's timeout: a finite number of seconds the store's waits take (`check_number`, at most
    `MAX_OS_WAIT_S`); an integer scalar as its int."""
    return check_number(owner, name, value, at_most=MAX_OS_WAIT_S)


@dataclass
class BarrierConfig(ABC):
    timeout_barrier_init_sec: int

    def __post_init__(self) -> None:
        """The store's timeout, refused naming the field: NaN, an int past a float or a str failed only when the
        barrier's store was made, with a bare ValueError or OverflowError."""
        self.timeout_barrier_init_sec = barrier_seconds(
            type(self).__name__, "timeout_barrier_init_sec", self.timeout_barrier_init_sec
        )

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
    """Role rank 0 hosts the store. Rounds are numbered by that store, per rank and `key_prefix`: each rank's k-th
    `execute_barrier` meets every other rank's k-th, whichever barrier object of the rank made it (one made again
    goes on from its rank's count), so barriers never mix."""

    def __init__(self, config: TCPStoreBarrierConfig, rank_info: RankInfo | None = None) -> None:
        self.config = config
        self.rank_info = rank_info or RankInfo.single()
        self._seq = 0
        self._kept_from = 1  # (role rank 0) the first round whose keys its store may still hold (`_forget_rounds`)
        self._host_store: Any = None  # a torch TCPStore, which torch.distributed does not export to type checkers
        if self.rank_info.role_rank == 0:
            self._host_store = _host(config)
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
        """Every failure is a `TimeoutError` in the barrier's words: the store's errors speak of a checkpoint's
        commit ("... closed its CheckpointManager. No checkpoint was committed"), which a barrier is not.

        The round is numbered by rank 0's store, one count per rank: a barrier made again (a writer process
        replaced) goes on from its rank's count, where its own count began at 1 again and found that round's
        arrivals of every rank still in the store (it passed at once, rank 0 nowhere near it). And the round's
        outcome is decided once for every rank (`_outcome`): a rank arriving after another gave up on the round
        found everyone's arrival and passed, while that rank raised."""
        timeout_secs = barrier_seconds("TCPStoreBarrier.execute_barrier", "timeout_secs", timeout_secs)
        number = self._seq + 1  # this barrier's guess, named if the host does not answer
        try:
            channel = self._get_channel(timeout_secs)
            number = channel.count(f"round/{self.rank_info.role_rank}")
            self._seq = number
            channel.publish(f"{number}/{self.rank_info.role_rank}", "arrived")
            try:
                channel.gather(
                    str(number),
                    self.rank_info.role_world_size,
                    f"arrival at barrier {number}",
                    during="TCPStoreBarrier",
                    call="execute_barrier()",
                    outcome="",
                )
            except CommitError as exc:
                if channel.spent:
                    raise
                self._outcome(channel, number, f"{_FAILED}{self.rank_info.role_rank}/{exc}")
                return  # every rank arrived after all, and one said so first
            try:
                self._outcome(channel, number, _PASSED)
            finally:
                self._forget_rounds(channel, number)
        except CommitError as exc:
            spent = self._channel is None or self._channel.spent  # the host failed, not a rank's arrival
            raise TimeoutError(self._host_failed(exc, timeout_secs, number) if spent else str(exc)) from exc
        except Exception:
            raise
        except BaseException as exc:
            self._leave(number, exc)
            raise

    def _leave(self, number: int, exc: BaseException) -> None:
        """This rank leaves round `number` (`exc`: Ctrl-C, a signal handler's sys.exit()): unless the round was
        decided passed first, it decides that it failed, naming this rank and why, then marks its arrival, so that
        every other rank's wait ends at once and raises that (`_outcome`). `exc` gets a note of what became of
        the round. Before, a rank interrupted before its arrival was published left the round unanswered: the
        others waited their whole timeout, then said it never called execute_barrier()."""
        channel, me = self._channel, self.rank_info.role_rank
        if channel is None or channel.spent:  # no host to tell: the others learn from their timeout
            return
        why = f"TCPStoreBarrier (barrier {number} of role rank {me}): rank {me} left it ({describe(exc)})"
        try:  # briefly: the rank is leaving, and a stopped host must not hold its Ctrl-C for the barrier's timeout
            decided = channel.decide(f"{number}/outcome", f"{_FAILED}{me}/{why}", wait_s=_LEAVING_WAIT_S)
            if decided != _PASSED:
                channel.publish(f"{number}/{me}", "left")
        except Exception as lost:  # leaving anyway: the others learn from their timeout
            logger.debug("TCPStoreBarrier: could not tell the other ranks that rank %s left: %r", me, lost)
            return
        how = "had passed for every rank" if decided == _PASSED else "failed for every rank: this rank left it"
        add_note(exc, f"TCPStoreBarrier: barrier {number} of role rank {me} {how}.")

    def _forget_rounds(self, channel: StoreChannel, number: int) -> None:
        """(Role rank 0, its store's host, once every rank arrived at round `number`.) Remove the arrivals and
        outcomes of the rounds before it from the store: a rank arrives at a round only after its call of the round
        before returned, so no rank reads them any more. Rounds rank 0 itself gave up on go at the next round every
        rank met. Before, every round's keys stayed for the store's life (a barrier per save grew it for the
        job's). A removal that fails is said at WARNING; the round passed all the same.

        It runs after the round's outcome is decided: run before, a removal that stalled (rank 0's store slow) spent
        the channel, and rank 0 raised on a round every other rank passed."""
        if self._host_store is None or number <= self._kept_from or channel.spent:
            return
        world = self.rank_info.role_world_size
        names = [f"{n}/{r}" for n in range(self._kept_from, number) for r in range(world)]
        names += [f"{n}/outcome" for n in range(self._kept_from, number)]
        try:
            channel.forget(names)
        except Exception as exc:  # housekeeping: no failure of it may change the round's outcome
            log_safely(
                logger,
                logging.WARNING,
                "TCPStoreBarrier: removing the keys of barriers %d-%d from its store failed (%s); they stay there",
                self._kept_from,
                number - 1,
                exc,
            )
            return
        self._kept_from = number

    def _outcome(self, channel: StoreChannel, number: int, proposal: str) -> None:
        """The round's outcome, the first proposal made to rank 0's store; a failure raised as the rank that gave
        up worded it, naming it where that is another rank."""
        decided = channel.decide(f"{number}/outcome", proposal)
        if decided == _PASSED:
            return
        who, _, why = decided[len(_FAILED) :].partition("/")
        if decided == proposal:
            raise TimeoutError(why)
        raise TimeoutError(
            f"TCPStoreBarrier (barrier {number} of role rank {self.rank_info.role_rank}): rank {who} gave up on it "
            f"first, so it failed for every rank: {why}"
        )

    def _host_failed(self, exc: CommitError, timeout_secs: int, number: int) -> str:
        where = f"rank 0, which hosts the barrier's store at {self.config.master_address}:{self.config.tcpstore_port},"
        if isinstance(exc, CommitOutcomeUnknownError):
            how = f"did not answer within {timeout_secs}s (it is stopped, hung, or cut off from this rank)"
        else:
            how = "is unreachable (it exited, or has not made its TCPStoreBarrier yet)"
        return f"TCPStoreBarrier (barrier {number} of role rank {self.rank_info.role_rank}): {where} {how}."


def _host(config: TCPStoreBarrierConfig) -> Any:
    """Role rank 0's store for the barrier; a port it cannot listen on is a `ConfigError` naming the field (torch's
    own error had pages of C++ frames and no word of which setting to change)."""
    try:
        return dist.TCPStore(  # type: ignore[attr-defined]
            config.master_address,
            config.tcpstore_port,
            is_master=True,
            timeout=timedelta(seconds=config.timeout_barrier_init_sec),
            wait_for_workers=False,
            use_libuv=config.use_checkpoint_barrier_tcpstore_libuv,
        )
    except dist.DistNetworkError as exc:
        first = (str(exc).strip().splitlines() or [""])[0].rstrip(".")
        in_use = " (the port is in use)" if _in_use(str(exc)) else ""
        raise ConfigError(
            f"TCPStoreBarrierConfig.tcpstore_port {config.tcpstore_port}: role rank 0 cannot host the barrier's "
            f"store at {config.master_address}:{config.tcpstore_port}{in_use}: {first}. Fix: pick a port that "
            f"nothing else listens on (each role-rank-0 TCPStoreBarrier hosts its own store), and a "
            f"master_address of this host."
        ) from None


def _in_use(said: str) -> bool:
    """Whether torch's listen error says the port is taken: the classic store says "Address already in use",
    the libuv one (torch's default) "EADDRINUSE ... address already in use"."""
    return "address already in use" in said.lower() or "EADDRINUSE" in said
