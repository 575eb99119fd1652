"""Round 28: a rank that leaves a `TCPStoreBarrier` round (Ctrl-C, a signal handler's sys.exit()) says so to
the others at once.

Rank 1, interrupted once its round was counted but before its arrival was published, left the round
unanswered: rank 0 waited its whole timeout, then said rank 1 "never called execute_barrier()" of a rank that
had, and had said why it left. Now a leaving rank decides the round failed (unless it was decided passed
first) and marks its arrival, so every other rank raises at once that rank 1 left it, and why; its own
interrupt says what became of the round.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any

import pytest

from torch_checkpointing.barriers import TCPStoreBarrier, TCPStoreBarrierConfig
from torch_checkpointing.types import RankInfo

HANG_S = 120  # rank 0's barrier timeout: only one that waits for an unanswered round reaches it


def _config() -> TCPStoreBarrierConfig:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TCPStoreBarrierConfig(30, False, port, "127.0.0.1", key_prefix="r28")


def _in_thread(barrier: TCPStoreBarrier) -> tuple[threading.Thread, list[str]]:
    said = [""]

    def run() -> None:
        try:
            barrier.execute_barrier(HANG_S)
            said[0] = "passed"
        except Exception as exc:
            said[0] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run)
    thread.start()
    return thread, said


def _interrupt_before_arriving(barrier: TCPStoreBarrier) -> None:
    """A real SIGINT (Python's own handler, on this main thread) lands once `barrier` counted its round, before
    it publishes its arrival."""
    made = barrier._get_channel

    def channel(timeout_secs: int) -> Any:
        barrier._get_channel = made  # type: ignore[method-assign]  # once
        made_channel = made(timeout_secs)
        publish = made_channel.publish

        def interrupted(name: str, value: str) -> None:
            if value == "arrived":
                made_channel.publish = publish  # once
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(HANG_S)  # the handler raises in here
            publish(name, value)

        made_channel.publish = interrupted
        return made_channel

    barrier._get_channel = channel  # type: ignore[method-assign]


def test_a_rank_interrupted_before_it_arrived_fails_the_round_at_once_for_the_others() -> None:
    config = _config()
    host = config.create_barrier(RankInfo(0, 2, 0, 2))
    other = config.create_barrier(RankInfo(1, 2, 1, 2))
    thread, said = _in_thread(host)
    _interrupt_before_arriving(other)
    with pytest.raises(KeyboardInterrupt) as left:
        other.execute_barrier(HANG_S)
    thread.join(HANG_S + 30)
    # Before: after HANG_S, "TimeoutError: TCPStoreBarrier ...: rank(s) [1] never called execute_barrier() ...".
    assert "never called" not in said[0], said
    assert said[0].startswith("TimeoutError: ") and "rank 1 gave up on it first" in said[0], said
    assert "interrupted" in said[0], said
    assert any("barrier 1" in note and "failed for every rank" in note for note in left.value.__notes__), left.value
    # The next round meets: both ranks count on from the round rank 1 left.
    thread, said = _in_thread(host)
    other.execute_barrier(HANG_S)
    thread.join(HANG_S + 30)
    assert said == ["passed"], said
