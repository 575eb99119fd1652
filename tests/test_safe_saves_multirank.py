"""Cross-rank agreement on real gloo ranks: one refusal anywhere is the same CommitError everywhere, at once."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.launcher import launch
from tests import safe_save_jobs

pytestmark = pytest.mark.multirank
WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("safe")
    return launch(safe_save_jobs.safe_save_checks, WORLD, args=(str(root),), timeout=180)


def _same_commit_error_everywhere(results: list[dict[str, Any]], field: str) -> str:
    errors = [r[field]["error"] for r in results]
    assert errors[0] is not None and errors[0].startswith("CommitError:"), errors
    assert all(e == errors[0] for e in errors), errors
    return str(errors[0])


def test_a_refusal_on_rank_0_after_the_plan_reaches_every_rank_as_one_error(results: list[dict[str, Any]]) -> None:
    # Two ranks saving one resharded item to a {rank}-less file: only rank 0 builds (and refuses) the metadata.
    # Before: rank 1 got "lost contact with rank 0" (or a raw DistNetworkError) after its timeout.
    error = _same_commit_error_everywhere(results, "rank0_refusal")
    assert "rank(s) [0]" in error and "model.pt" in error, error
    for r in results:
        assert r["rank0_refusal"]["failures"] == [0]
        assert r["rank0_refusal"]["seconds"] < 15, "a rank waited for a timeout instead of hearing the refusal"
        assert not r["rank0_refusal_exists"]


def test_ranks_saving_different_ids_commit_nothing(results: list[dict[str, Any]]) -> None:
    # Before: both ranks got ok; step_10 was committed listing model_1.pt, which sat in an orphaned temp dir.
    error = _same_commit_error_everywhere(results, "ids")
    assert "step_11" in error and "step_10" in error, error
    for r in results:
        assert r["ids"]["failures"] == [1]
        assert r["ids_left"] == []


def test_a_directory_that_is_not_a_checkpoint_is_refused_on_every_rank(results: list[dict[str, Any]]) -> None:
    error = _same_commit_error_everywhere(results, "user_dir")
    assert "train.log" in error and "not a checkpoint" in error, error
    for r in results:
        assert r["user_files"] == ["train.log"]
        assert r["after"]["error"] is None, "the manager could not save after a refused save"
