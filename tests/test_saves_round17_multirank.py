"""Round 17 on real gloo ranks: what two ranks write together is refused before anything is written."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.launcher import launch
from tests import saves_round17_jobs

pytestmark = pytest.mark.multirank
WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("round17")
    return launch(saves_round17_jobs.round17_checks, WORLD, args=(str(root),), timeout=180)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_file_of_one_rank_that_is_the_folder_of_another_ranks_file_is_refused_up_front(
    results: list[dict[str, Any]], mode: str
) -> None:
    # Before: the ranks wrote until the second one to reach the path failed with a bare IsADirectoryError or
    # FileExistsError (whichever rank came second), naming neither item nor the fix.
    errors = [r[f"cross_{mode}"]["error"] for r in results]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0].startswith("CommitError: Item 'y' on rank 1"), errors[0]
    assert "'01/y.pt', inside '01', the file of item 'x' on rank 0" in errors[0], errors[0]
    assert "LayoutInfo.file_path" in errors[0] and "Nothing was written" in errors[0], errors[0]
    for r in results:
        assert r[f"cross_{mode}"]["failures"] == [0, 1]
        assert r[f"cross_{mode}_left"] == []
