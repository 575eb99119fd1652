"""A signal handler's own exception held inside torch's `all_gather_object` is raised as itself (two real gloo
ranks, one launch; round 30).

Round 29 holds a signal that lands in the ranks' exchange of answers until the exchange is done, and runs its
handler at the end of the hold. The hold sat inside the exchange's `except Exception`, which takes any exception
for gloo's word that a peer died: a handler raising anything but a KeyboardInterrupt or SystemExit (SIGALRM's
TimeoutError, a program's bound on the call; a preemption handler's own error) was raised as "rank 1 lost
contact with its peers (<the handler's words>); a rank died, hung, or never called save()", `from None`: the
handler's exception gone, a healthy group called broken. The signal here is a real SIGALRM, sent on rank 1
between the exchange's two gathers.

The ranks' job is the "handler_error" part of the one launch in tests/interrupted_rank_jobs.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interrupted_rank_jobs import HANDLER_ERROR_CALLS as CALLS
from tests.interrupted_rank_jobs import interrupted_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return interrupted_ranks("handler_error", tmp_path_factory)


@pytest.mark.parametrize("call", CALLS)
def test_the_handlers_exception_is_raised_as_itself(ranks: list[dict[str, Any]], call: str) -> None:
    """Defect: "CommitError: ...: rank 1 lost contact with its peers (the call took too long) ..."."""
    assert ranks[1][call].startswith("TimeoutError: the call took too long"), ranks


@pytest.mark.parametrize("call", CALLS)
def test_rank_0_hears_of_it_and_the_ranks_go_on_together(ranks: list[dict[str, Any]], call: str) -> None:
    said = ranks[0][call]
    assert "went silent" not in said and "rank 1: TimeoutError" in said, ranks
    assert [r[f"{call}_then"] for r in ranks] == [10.0, 11.0], ranks
