"""A rank whose writer answers a commit step after another rank gave up on it (two real gloo ranks, one launch).

Rank 1's writer is SIGSTOPped while the save's request waits in its pipe; rank 0's writer waits the save's
timeout for rank 1's answer to "writing the files", gives up and fails the save: "rank(s) [1] did not report ...
No checkpoint was committed". Then rank 1's writer is let go. Its files are written, every rank's answer is in
the store (rank 0 answered before it gave up), so it went on to the commit step, waited the timeout again for
rank 0, and raised `CommitOutcomeUnknownError` ("the id holds either its previous checkpoint or this one"): a
different error, a different story, for a save that every rank must report alike, and twice the wait. Now a
rank that gives up on a step decides it for every rank (the first decision on rank 0's store wins), and a rank
that arrives later raises the same `CommitError`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.async_multirank_support import local_async_manager
from tests.probes import stop

pytestmark = pytest.mark.multirank
TIMEOUT_S = 8


def _state(rank: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((4,), float(rank))}}


def _late_rank(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    manager = local_async_manager(TIMEOUT_S)
    out: dict[str, Any] = {}
    try:
        manager.save(f"{root}/a", _state(rank)).result(120)  # type: ignore[union-attr]
        pid = manager.writer_pid
        assert pid is not None
        if rank == 1:
            stop(pid)  # alive, but reads nothing: the request waits in its pipe
        dist.barrier()
        future = manager.save(f"{root}/b", _state(rank))
        assert future is not None
        if rank == 0:
            out["error"] = future.exception(120)  # rank 0 gave up on rank 1
        dist.barrier()  # rank 1's writer is let go only once rank 0 has failed the save
        if rank == 1:
            started = time.monotonic()
            os.kill(pid, signal.SIGCONT)
            out["error"] = future.exception(120)
            out["late_s"] = time.monotonic() - started
        dist.barrier()  # rank 0's trainer hosts the store: it stays until rank 1 has its answer
        out["b"] = sorted(p.name for p in Path(root).iterdir() if p.name == "b")
    finally:
        try:
            manager.close()
        except Exception as exc:  # the failed save's error again: reported above
            out.setdefault("close", repr(exc))
    out["error"] = None if out.get("error") is None else (type(out["error"]).__name__, str(out["error"]))
    return out


@pytest.fixture(scope="module")
def late(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("late")
    return launch(_late_rank, 2, args=(str(root),), timeout=300)


def test_a_rank_that_answers_after_another_gave_up_raises_the_same_error(late: list[dict[str, Any]]) -> None:
    first, second = late[0]["error"], late[1]["error"]
    assert first is not None and first[0] == "CommitError", late
    assert "did not report" in first[1] and "No checkpoint was committed" in first[1], first
    assert second == first, late


def test_the_late_rank_does_not_wait_the_timeout_again(late: list[dict[str, Any]]) -> None:
    assert late[1]["late_s"] < TIMEOUT_S, late


def test_nothing_was_committed(late: list[dict[str, Any]]) -> None:
    assert late[0]["b"] == [] and late[1]["b"] == [], late
