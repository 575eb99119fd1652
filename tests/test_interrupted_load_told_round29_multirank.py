"""A real SIGINT on rank 1 at each point of a collective load (two real gloo ranks, one launch; round 29):
before its first copy (in the check), during its copies, after the last agreed step (the read context closing).

Before, rank 1 raised a bare KeyboardInterrupt at each point, whatever its templates held. Now its note says:
nothing was restored (the check), or every template holds the checkpoint whole (the copy, whose interrupt is
held until every rank has said its copy finished, and after it). Rank 0 raises where rank 1 left in the check,
and returns where every rank's copy finished; the ranks load together afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.async_multirank_support import launch_job, loaded, local_sync_manager, said, state
from tests.sigint_at import sigint_at
from torch_checkpointing import checkpoint_loader

pytestmark = pytest.mark.multirank
TIMEOUT_S = 20  # save.wait_timeout_secs: the gloo group's timeout
HANG_S = 120  # what the interrupted rank's own wait is bounded by: the SIGINT ends it at once
POINTS = ["check", "copy", "after"]


def _arm(point: str) -> None:
    """A real SIGINT as the load reaches `point`, before the call there runs."""
    if point == "check":
        sigint_at(checkpoint_loader, "check_shared_targets", HANG_S)
    elif point == "copy":  # held until the copy has finished: the wait runs to its end
        copying = lambda *a, **k: "unexpected" in k and not k.get("dry_run", False)  # noqa: E731
        sigint_at(checkpoint_loader, "walk_checkpoint_structure", 0.5, when=copying)
    else:
        sigint_at(checkpoint_loader.CheckedLoad, "close", HANG_S)


def _job(root: str, control_dir: str) -> dict[str, Any]:
    rank, out = dist.get_rank(), {}
    manager = local_sync_manager(TIMEOUT_S)
    manager.save(f"{root}/ck", state(1, rank))
    for point in POINTS:
        dist.barrier()
        if rank == 1:
            _arm(point)
        into = {"model": {"w": torch.zeros(4)}}
        out[point] = said(lambda: manager.load(f"{root}/ck", into), notes=True)  # noqa: B023
        out[f"{point}_held"] = float(into["model"]["w"][0])
        dist.barrier()
        out[f"{point}_then"] = loaded(manager, f"{root}/ck")
    manager.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_job(_job, 2, Path(tmp_path_factory.mktemp("interrupted_load_told")), timeout=600)


WORDS = {
    "check": "before any template was changed: nothing was restored",
    "copy": "after the copy had finished: every template holds the checkpoint, whole",
    "after": "after the copy had finished: every template holds the checkpoint, whole",
}


@pytest.mark.parametrize("point", POINTS)
def test_rank_1_says_what_its_templates_hold(ranks: list[dict[str, Any]], point: str) -> None:
    said = ranks[1][point]
    # Before: "KeyboardInterrupt: " and nothing more, at every point.
    assert said.startswith("KeyboardInterrupt: ") and WORDS[point] in said, ranks
    assert ranks[1][f"{point}_held"] == (0.0 if point == "check" else 11.0), ranks


@pytest.mark.parametrize("point", POINTS)
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


@pytest.mark.parametrize("point", POINTS)
def test_the_ranks_load_together_afterwards(ranks: list[dict[str, Any]], point: str) -> None:
    assert [r[f"{point}_then"] for r in ranks] == [10.0, 11.0], ranks
