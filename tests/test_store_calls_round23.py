"""The threads that make a store channel's calls (round 23 review).

Every call on rank 0's store is bounded (`StoreChannel._call`). Each call started a thread of its own: about
0.3 ms apiece, 20 times the call itself, several dozen times per save (a 2-rank save's time to durable rose by
about a fifth); and with the host stopped (SIGSTOP), each save left one more thread blocked on it for good. The
calls on one host are now made by a few reused threads. A real TCPStore host, in this process or in a child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from tests.probes import fresh_fork_statuses, stop
from torch_checkpointing import CommitOutcomeUnknownError, store_channel
from torch_checkpointing.store_channel import StoreAddress, StoreChannel

HOST = """
import time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(120)
"""


@pytest.fixture
def host() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    yield store


def _channel(port: int, timeout_s: float = 30.0, store: Any = None) -> StoreChannel:
    return StoreChannel(StoreAddress("127.0.0.1", port, "ns"), timeout_s, store)


def _store_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("ckpt-store"))


def test_store_calls_reuse_their_thread_instead_of_starting_one_each(
    host: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []
    real_start = store_channel.start_thread

    def counting(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(store_channel, "start_thread", counting)
    channel = _channel(host.port)
    for i in range(50):
        channel.publish(f"k/{i}", "v")
        assert channel.wait_value(f"k/{i}", 5.0) == "v"
    assert channel.gather("k", 50, "k") == ["v"] * 50
    assert len(started) <= 1, f"{len(started)} threads started for about 150 calls"


def test_saves_on_a_stopped_host_leave_a_bounded_number_of_threads_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_channel, "_CALL_GRACE_S", 0.0)
    proc = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        clients = [
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1), wait_for_workers=False)  # type: ignore[attr-defined]
            for _ in range(8)
        ]
        before = _store_threads()
        stop(proc.pid)
        for client in clients:  # eight saves, each with its own connection, while the host stays stopped
            with pytest.raises(CommitOutcomeUnknownError, match="did not answer"):
                _channel(port, 0.2, client).missing("k", 1)
        blocked = _store_threads() - before
        assert blocked <= 4, f"{blocked} threads blocked on the stopped host, one more for each save"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(30)


def test_a_forked_child_makes_its_store_calls() -> None:
    """The parent's caller thread is not in the child: the child's calls are made by its own. (Forked from a new
    interpreter: see `fresh_fork_statuses`.)"""
    (status,) = fresh_fork_statuses(
        """
        import torch.distributed as dist
        from torch_checkpointing.store_channel import StoreAddress, StoreChannel
        host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        def channel(timeout_s):
            return StoreChannel(StoreAddress("127.0.0.1", host.port, "ns"), timeout_s, None)
        channel(30.0).publish("parent", "1")  # the parent's caller thread is running now
        def child():
            mine = channel(2.0)
            mine.publish("child", "1")
            return mine.wait_value("child", 2.0) == "1"
        """,
        ["child()"],
    )
    assert status == 0, status


def test_every_rank_that_rank_0_does_not_answer_raises_the_same_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank connected before rank 0 stopped (its call goes unanswered), another connects after (its connect
    does): before, their errors differed by the wait each had allowed ("within 8s" and "within 16s")."""
    monkeypatch.setattr(store_channel, "_CALL_GRACE_S", 0.0)
    proc = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        connected = _channel(port, 0.5)
        stop(proc.pid)
        with pytest.raises(CommitOutcomeUnknownError) as called:
            connected.missing("k", 1)
        with pytest.raises(CommitOutcomeUnknownError) as connecting:
            _channel(port, 0.5).missing("k", 1)
        assert str(called.value) == str(connecting.value)
        assert called.value.failures == connecting.value.failures
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(30)
