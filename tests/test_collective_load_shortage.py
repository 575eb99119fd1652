"""A collective load that ranks cannot make for want of memory or file descriptors is told so on every rank.

The rank short of the resource raises a `MemoryError`, or an `OSError` with `errno.EMFILE`, saying the checkpoint
was not found damaged (docs/guide.md); the other ranks raised a plain `CheckpointError` ("checking failed on
rank(s) [1]: ..."). A caller's handler for the shortage (free memory or files, then load again, collectively) ran
on one rank only: that rank's retry waited in a collective the others never joined, and the others took the
intact checkpoint for one that cannot be loaded. Real gloo ranks, a real shortage on rank 1.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

from simulator.launcher import launch
from tests import multirank_jobs

pytestmark = pytest.mark.multirank


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd and memfd copies are Linux's")
@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the copy refused for memory is made only with memfd")
@pytest.mark.parametrize(
    ("kind", "told"), [("descriptors", f"OSError: [Errno {errno.EMFILE}]"), ("memory", "MemoryError:")]
)
def test_every_rank_is_told_the_shortage_of_one(tmp_path: Path, kind: str, told: str) -> None:
    """Defect: rank 0 raised `CheckpointError: Checkpoint load of .../ck: checking failed on rank(s) [1]: rank 1:
    OSError: [Errno 24] Out of file descriptors ...`, where rank 1 raised the `OSError` itself."""
    outcomes = launch(multirank_jobs.shortage_on_one_rank, 2, args=(str(tmp_path), kind), timeout=240)
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith(told), f"rank {rank}: {outcome}"
        assert "not found damaged" in outcome and str(tmp_path / "ck") in outcome, f"rank {rank}: {outcome}"
    assert "rank(s) [1]" in outcomes[0], outcomes[0]  # the rank that was short is named to the others


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd and memfd copies are Linux's")
@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the copy refused for memory is made only with memfd")
def test_ranks_short_of_different_resources_all_raise_the_lowest_ones(tmp_path: Path) -> None:
    """Rank 1 short of memory, rank 2 of descriptors: every rank raises rank 1's `MemoryError` (docs/guide.md),
    naming both ranks' shortages; rank 2's own `OSError` is its cause.

    Defect: rank 0 raised `CheckpointError: ... failed on rank(s) [1, 2]: rank 1: MemoryError: ...; rank 2: OSError:
    [Errno 24] ...`, rank 1 its `MemoryError` and rank 2 its `OSError`: three types, so a handler for either
    shortage ran on some ranks and left the others waiting in the retry's collectives."""
    outcomes = launch(multirank_jobs.shortage_on_one_rank, 3, args=(str(tmp_path), "mixed"), timeout=300)
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith("MemoryError:"), f"rank {rank}: {outcome}"
        assert "not found damaged" in outcome and str(tmp_path / "ck") in outcome, f"rank {rank}: {outcome}"
    for rank in (0, 2):
        assert "rank(s) [1, 2]" in outcomes[rank] and f"[Errno {errno.EMFILE}]" in outcomes[rank], outcomes[rank]
