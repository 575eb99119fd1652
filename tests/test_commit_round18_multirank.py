"""A rank's writer gone after rank 0 committed: what the surviving ranks are told (real gloo ranks).

The design document's rule: once the checkpoint is committed, nothing is reported as a failure. Rank 0 publishes
the manifest inside the commit step; a writer that dies after that, before it answers the step, changes nothing
about what the id holds.
"""

from __future__ import annotations

from typing import Any

import pytest

from simulator.launcher import launch
from tests import commit_round18_jobs

pytestmark = pytest.mark.multirank
WORLD = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("round18_commit")
    return launch(commit_round18_jobs.writers_gone_after_the_commit, WORLD, args=(str(root),), timeout=240)


def test_the_surviving_ranks_report_the_committed_save_as_committed(results: list[dict[str, Any]]) -> None:
    # Before: ranks 0 and 2 raised CommitError "rank(s) [1] did not report its answer to '...: the commit' ...
    # No checkpoint was committed." while the checkpoint was in place and loaded whole.
    first = [r["first"] for r in results]
    assert all(r["manifest_there"] for r in first), first
    for r in (first[0], first[2]):
        assert r["error"] is None, r["error"]


def test_a_rank_whose_writer_died_after_rank_0_committed_is_told_the_save_is_done(
    results: list[dict[str, Any]],
) -> None:
    # Before: rank 1 raised WriterProcessDied ("the id holds its previous checkpoint, or this one") while ranks 0
    # and 2 reported the checkpoint committed. Its trainer now answers the commit step in its dead writer's place
    # and hears from rank 0 that it committed.
    dead = results[1]["first"]
    assert dead["error"] is None, dead["error"]
    assert not [line for line in dead["logged"] if "Checkpoint save of" in line], dead["logged"]
    for r in results:
        assert r["first"]["loaded"] == [float(r["rank"] + 1)] * 4, r


def test_rank_0_whose_writer_died_after_publishing_is_told_the_save_is_done_on_every_rank_at_once(
    results: list[dict[str, Any]],
) -> None:
    # Before: rank 0 raised WriterProcessDied ("the id holds its previous checkpoint, or this one") and ranks 1 and
    # 2 waited the save's whole timeout (10 s) for rank 0's answer to the commit step, then raised
    # CommitOutcomeUnknownError. Rank 0's trainer now sees its writer's checkpoint in place (`Commit.adopt`) and
    # answers the commit step in its writer's place. "At once" is not a number of seconds (one was: `s < 5`, which
    # a load average of 15 broke): the save's timeout is longer than any load makes the step, and a rank that
    # waited it out either raised or logged that not every rank answered (rank 0's answer came after it).
    for r in results:
        second = r["second"]
        assert second["error"] is None, second["error"]
        assert not [line for line in second["warned"] if "not every rank answered" in line], second
        assert second["loaded"] == [float(r["rank"] + 1)] * 4, r
        assert not [line for line in second["logged"] if "Checkpoint save of" in line], second["logged"]
