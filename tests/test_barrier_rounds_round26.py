"""Round 26: a `TCPStoreBarrier` round is one the ranks agree on, whoever made the barrier when.

Each barrier numbered its rounds itself (1, 2, ...) and a round's arrivals stayed in rank 0's store for good:
* a barrier made again on role rank 1 (a writer process replaced, a barrier made per save) started at round 1
  again, found round 1's arrivals of every rank still there, and passed at once while rank 0 was nowhere near it;
* a rank that arrived after rank 0 had given up on a round (a TimeoutError there) found rank 0's arrival and
  passed: one rank said the barrier failed, the other that every rank had met.
Now the round is counted by rank 0's store for each rank (a barrier made again goes on from its rank's count),
and its outcome is decided once, by the first rank to see everyone arrived or to give up, for every rank.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from torch_checkpointing.barriers import TCPStoreBarrier, TCPStoreBarrierConfig
from torch_checkpointing.types import RankInfo

# The timeout of a barrier told at once that the round failed: only a barrier that waits it out ends after it (a
# bound of 10 s, a third of the timeout, was not always met on a busy 2-core machine).
OWN_TIMEOUT_S = 120


def _config() -> TCPStoreBarrierConfig:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TCPStoreBarrierConfig(30, False, port, "127.0.0.1", key_prefix="r26")


def _together(*barriers: TCPStoreBarrier, timeout_s: int = 30) -> list[str]:
    """Every barrier's execute_barrier at once, one thread each: 'passed' or the error each raised."""
    said = [""] * len(barriers)

    def run(k: int) -> None:
        try:
            barriers[k].execute_barrier(timeout_s)
            said[k] = "passed"
        except Exception as exc:
            said[k] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(barriers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return said


def test_a_barrier_made_again_on_rank_1_waits_for_rank_0() -> None:
    config = _config()
    host = config.create_barrier(RankInfo(0, 2, 0, 2))
    assert _together(host, config.create_barrier(RankInfo(1, 2, 1, 2))) == ["passed", "passed"]
    again = config.create_barrier(RankInfo(1, 2, 1, 2))  # rank 0 does not come this time
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\]"):
        again.execute_barrier(1)
    assert time.monotonic() - started >= 1.0
    # Rank 0's next round is the one rank 1 gave up on: it fails there too, at once; the round after meets.
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"barrier 2 .*rank 1 gave up"):
        host.execute_barrier(OWN_TIMEOUT_S)
    assert time.monotonic() - started < OWN_TIMEOUT_S, "told at once, not after its own timeout"
    assert _together(host, again) == ["passed", "passed"]


def test_a_rank_arriving_after_another_gave_up_on_the_round_fails_it_too() -> None:
    config = _config()
    host = config.create_barrier(RankInfo(0, 2, 0, 2))
    other = config.create_barrier(RankInfo(1, 2, 1, 2))
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
        host.execute_barrier(1)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"barrier 1 .*rank 0 gave up") as late:
        other.execute_barrier(OWN_TIMEOUT_S)
    assert time.monotonic() - started < OWN_TIMEOUT_S, "told at once, not after its own timeout"
    assert "rank(s) [1]" in str(late.value), late.value
    assert _together(host, other) == ["passed", "passed"]  # the ranks stay in step: the next round meets


def _keys(config: TCPStoreBarrierConfig) -> int:
    """How many keys the barrier's host store holds, read by a client of its own."""
    client = dist.TCPStore(config.master_address, config.tcpstore_port, is_master=False, timeout=timedelta(seconds=30))
    return int(client.num_keys())


def test_the_host_store_holds_no_more_keys_after_many_rounds_than_after_a_few() -> None:
    # Round 27. Before: every round left its arrivals and its outcome in rank 0's store for good, three keys a
    # round with two ranks (a job's barrier per save grew it for the job's life): 3 -> 10 rounds went 21 -> 42.
    # Rank 0 now removes a round's keys once every rank has arrived at the next one, so none of them still reads.
    config = _config()
    host, other = config.create_barrier(RankInfo(0, 2, 0, 2)), config.create_barrier(RankInfo(1, 2, 1, 2))
    for _ in range(3):
        assert _together(host, other) == ["passed", "passed"]
    few = _keys(config)
    for _ in range(7):
        assert _together(host, other) == ["passed", "passed"]
    assert _keys(config) == few
    # A round one rank gave up on is removed too, and the ranks stay in step.
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
        host.execute_barrier(1)
    with pytest.raises(TimeoutError, match=r"rank 0 gave up"):
        other.execute_barrier(30)
    for _ in range(2):
        assert _together(host, other) == ["passed", "passed"]
    assert _keys(config) == few
