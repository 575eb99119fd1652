"""A real SIGINT on rank 1 at each point of a collective load (two real gloo ranks, one launch; round 29):
before its first copy (in the check), during its copies, after the last agreed step (the read context closing).

Before, rank 1 raised a bare KeyboardInterrupt at each point, whatever its templates held. Now its note says:
nothing was restored (the check), or every template holds the checkpoint whole (the copy, whose interrupt is
held until every rank has said its copy finished, and after it). Rank 0 raises where rank 1 left in the check,
and returns where every rank's copy finished; the ranks load together afterwards.

The ranks' job is the "told" part of the one launch in tests/interrupted_rank_jobs.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interrupted_rank_jobs import TOLD_POINTS, interrupted_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return interrupted_ranks("told", tmp_path_factory)


WORDS = {
    "check": "before any template was changed: nothing was restored",
    "copy": "after the copy had finished: every template holds the checkpoint, whole",
    "after": "after the copy had finished: every template holds the checkpoint, whole",
}


@pytest.mark.parametrize("point", TOLD_POINTS)
def test_rank_1_says_what_its_templates_hold(ranks: list[dict[str, Any]], point: str) -> None:
    said = ranks[1][point]
    # Before: "KeyboardInterrupt: " and nothing more, at every point.
    assert said.startswith("KeyboardInterrupt: ") and WORDS[point] in said, ranks
    assert ranks[1][f"{point}_held"] == (0.0 if point == "check" else 11.0), ranks


@pytest.mark.parametrize("point", TOLD_POINTS)
def test_rank_0_is_told_at_once_or_returns(ranks: list[dict[str, Any]], point: str) -> None:
    said = ranks[0][point]
    if point != "check":  # every rank's copy finished: rank 0's load returned
        # Before, for "copy": "CheckpointError: Checkpoint load of …: restoring (ranks that did not fail have
        # already filled their templates) failed on rank(s) [1]: rank 1: KeyboardInterrupt: …", of a rank 1 whose
        # templates held the checkpoint whole.
        assert said == "ok" and ranks[0][f"{point}_held"] == 10.0, ranks
        return
    assert "rank 1: KeyboardInterrupt" in said and "went silent" not in said, ranks
    assert ranks[0][f"{point}_held"] == (0.0 if point == "check" else 10.0), ranks


@pytest.mark.parametrize("point", TOLD_POINTS)
def test_the_ranks_load_together_afterwards(ranks: list[dict[str, Any]], point: str) -> None:
    assert [r[f"{point}_then"] for r in ranks] == [10.0, 11.0], ranks


def test_the_held_interrupt_says_when_a_second_one_is_acted_on(ranks: list[dict[str, Any]]) -> None:
    """Round 31: the WARNING said "send it again to run it now", untrue while the rank waits in the ranks' gather
    (gloo's C++ wait runs no Python handler); it says when a second signal is acted on."""
    held = [line for line in ranks[1]["warnings"] if "during the copy into the templates and the ranks' word" in line]
    assert len(held) == 1, ranks[1]["warnings"]
    assert "run it now" not in held[0], held
    assert "only when that wait returns (no Python handler runs inside gloo's wait)" in held[0], held
