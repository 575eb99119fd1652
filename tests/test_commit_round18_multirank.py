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


def test_rank_0_whose_writer_died_is_told_so_and_the_checkpoint_loads_whole_everywhere(
    results: list[dict[str, Any]],
) -> None:
    error = results[0]["second"]["error"]
    assert error is not None and "WriterProcessDied" in error, error
    assert "or this one if the writer died right after committing it" in error, error
    for r in results:
        assert r["second"]["loaded"] == [float(r["rank"] + 1)] * 4, r
    # Before: its log line said "nothing was committed there" before an error saying it may have been.
    failed = [line for line in results[0]["second"]["logged"] if "Checkpoint save of" in line]
    assert failed and all("nothing was committed" not in line for line in failed), failed
    assert all("may have been committed right before it failed" in line for line in failed), failed


def test_when_rank_0_is_the_one_gone_the_others_are_told_the_outcome_is_unknown(
    results: list[dict[str, Any]],
) -> None:
    # Before: "... did not report ... No checkpoint was committed." for a checkpoint rank 0 had published.
    for r in (results[1], results[2]):
        error = r["second"]["error"]
        assert error is not None and error.startswith("CommitOutcomeUnknownError:"), error
        assert "No checkpoint was committed" not in error, error
        assert "rank 0 did not say whether it committed" in error, error
        assert "holds either its previous checkpoint or this one" in error, error
