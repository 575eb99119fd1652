"""An async save whose staging copy fails on one rank only (two real gloo ranks, one launch; round 23).

The ranks agree on the plan, then each rank's saver stages its tensors before handing the save to its writer
process. A staging failure on rank 1 (its shared-memory slab refused by the file-size limit, RLIMIT_FSIZE; or a
`prewarm_staging` copy that had failed, raised by the next save) was raised by rank 1's save() alone, and its
writer never heard of the save. Rank 0's writer waited the save's whole timeout for rank 1's files, then failed
with a different error: "rank(s) [1] did not report its answer ... within Ns", where rank 1 had raised a bare
OSError. Now rank 1 answers the commit's first agreement with its failure: both ranks raise the same
`CommitError` naming rank 1 and its reason at once, and the next save goes on as usual on both.
"""

from __future__ import annotations

import resource
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.async_multirank_support import loaded, local_async_manager, state, timed
from torch_checkpointing import CheckpointManager

pytestmark = pytest.mark.multirank
TIMEOUT_S = 30  # save.wait_timeout_secs: the old code made rank 0 wait this long
LIMIT = 64 << 10  # rank 1's file-size limit while it stages: below the slab for `_big`
FAST_S = TIMEOUT_S / 2


def _big(rank: int) -> dict[str, Any]:
    """A state whose staging slab (1 MiB) does not fit under `LIMIT`."""
    return {"model": {"w": torch.full((1 << 18,), float(rank))}}


def _file_size_limit(on: bool) -> None:
    """Lower (or restore) this process's RLIMIT_FSIZE; past it a write fails with EFBIG (SIGXFSZ ignored)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT if on else resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _timed(fn: Any) -> dict[str, Any]:
    """`fn()` (a save; its Future waited for): "ok" or `Type: message`, and how long it took."""
    return timed(lambda: fn().result(120))


def _save_with_rank_1_limited(manager: CheckpointManager, path: str, payload: dict[str, Any]) -> dict[str, Any]:
    rank = dist.get_rank()
    if rank == 1:
        _file_size_limit(True)
    try:
        return _timed(lambda: manager.save(path, payload))
    finally:
        if rank == 1:
            _file_size_limit(False)


def _job(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    manager = local_async_manager(TIMEOUT_S)
    out: dict[str, Any] = {}
    # 1. The first save: rank 0's writer is starting while rank 1's staging fails.
    out["first"] = _save_with_rank_1_limited(manager, f"{root}/first", _big(rank))
    dist.barrier()
    out["then"] = _timed(lambda: manager.save(f"{root}/then", state(1, rank)))["result"]
    # 2. Steady state: a prewarm_staging that failed on rank 1 is raised by its next save.
    if rank == 1:
        _file_size_limit(True)
        manager.prewarm_staging(_big(rank))
        time.sleep(1)  # the prewarm copy runs (and fails) on the staging thread
        _file_size_limit(False)
    dist.barrier()
    out["prewarmed"] = _timed(lambda: manager.save(f"{root}/prewarmed", _big(rank)))
    dist.barrier()
    out["after"] = _timed(lambda: manager.save(f"{root}/after", state(2, rank)))["result"]
    out["after_loaded"] = loaded(manager, f"{root}/after")
    out["then_loaded"] = loaded(manager, f"{root}/then")
    try:
        manager.close()
        out["close"] = "ok"
    except Exception as exc:  # before: the failed prewarm again
        out["close"] = f"{type(exc).__name__}: {exc}"
    out["left"] = sorted(p.name for p in Path(root).iterdir())
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("staging")
    return launch(_job, 2, args=(str(root),), timeout=400)


@pytest.mark.parametrize("case", ["first", "prewarmed"])
def test_a_staging_failure_on_rank_1_fails_every_rank_alike_at_once(ranks: list[dict[str, Any]], case: str) -> None:
    got = [ranks[r][case] for r in (0, 1)]
    assert got[0]["result"] == got[1]["result"], got  # before: rank 0 "did not report", rank 1 a bare OSError
    assert got[0]["result"].startswith("CommitError: ") and "rank(s) [1]" in got[0]["result"], got
    assert "Errno 27" in got[0]["result"], got  # rank 1's own reason reaches rank 0
    assert all(one["elapsed"] < FAST_S for one in got), got  # before: rank 0 waited the whole timeout


def test_the_failed_saves_leave_nothing_and_are_raised_once(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        assert out["then"] == "ok" and out["after"] == "ok" and out["close"] == "ok", out  # before: the failed
        # prewarm was raised again by every later save() and by close()
        assert out["after_loaded"] == 20.0 + rank and out["then_loaded"] == 10.0 + rank, out
        assert out["left"] == ["after", "then"], out  # no temporary directory, no failed checkpoint
