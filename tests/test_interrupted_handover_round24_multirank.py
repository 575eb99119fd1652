"""Ctrl-C (a real SIGINT) on one rank while its async save() hands the staged save to its comm thread (two real
gloo ranks, one launch; round 24).

A Ctrl-C while the rank stages is answered for its writer (test_interrupted_staging_round24_multirank). One
that lands a moment later, inside the hand-over before the write job is queued, was not: save() failed its
Future itself (`WriteFuture.claim`) and raised, the job that would have told the other ranks (`_abandon`) was
never queued, and rank 0's writer waited the save's whole timeout, then called rank 1 silent. Now save()
queues the answer itself whenever it claimed the write: rank 0 raises at once the error naming rank 1's
interrupt.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tests.async_multirank_support import launch_job
from tests.test_interrupted_staging_round24_multirank import FAST_S, interrupted_save_job
from torch_checkpointing import CheckpointManager

pytestmark = pytest.mark.multirank


def _interrupt_handover(manager: CheckpointManager) -> None:
    """This rank's next save is interrupted by a real SIGINT inside its hand-over, before the job is queued."""
    saver: Any = manager._saver
    staged_for, comm = saver._staged_for, saver._comm
    submit = comm.submit

    def interrupted(job: Any) -> None:
        comm.submit = submit  # once
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises in here, before the job is queued
        submit(job)

    def staged_then_armed(plan: Any) -> Any:
        saver._staged_for = staged_for
        staged = staged_for(plan)
        comm.submit = interrupted
        return staged

    saver._staged_for = staged_then_armed


def _job(root: str, control: str) -> dict[str, Any]:
    return interrupted_save_job(_interrupt_handover, root)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_job(_job, 2, tmp_path_factory.mktemp("handover"), timeout=300)


def test_the_other_rank_raises_at_once_naming_the_interrupted_rank(ranks: list[dict[str, Any]]) -> None:
    assert ranks[1]["interrupted"]["result"].startswith("KeyboardInterrupt"), ranks
    other = ranks[0]["interrupted"]
    assert other["result"].startswith("CommitError: ") and "rank(s) [1]" in other["result"], ranks
    assert "interrupted" in other["result"] and "KeyboardInterrupt" in other["result"], ranks
    assert other["elapsed"] < FAST_S, ranks  # before: the save's whole timeout, then "did not report"


def test_nothing_is_committed_and_the_next_save_goes_on(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        assert out["warm"] == "ok" and out["after"] == "ok", out
        assert out["after_loaded"] == 20.0 + rank, out
        assert out["left"] == ["after", "warm"], out
