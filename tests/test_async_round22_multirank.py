"""Rank 0's own writer process is SIGKILLed in the commit, after every rank's files are in (two real gloo ranks,
one launch, saves of one id in a row).

* While it writes the manifest (nothing is in place yet): every rank must raise the same `CommitError` at once,
  and the id must still hold the earlier checkpoint, with nothing of the failed save left beside it.
* Right after it swapped the checkpoint into place (the replaced one still at its temporary name, the commit step
  unanswered): the checkpoint is committed, so every rank must say the save is done, at once, and the replaced
  checkpoint must be gone.

Before, in both, rank 0 raised `WriterProcessDied` ("the id holds its previous checkpoint, or this one") while
rank 1's writer waited the save's whole timeout for rank 0's answer to the commit step, then raised
`CommitOutcomeUnknownError`: two stories, and the timeout's wait.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests import async_multirank_support as shared
from tests.commit_round18_jobs import wait_for_the_writer
from tests.memory_storage import Control
from torch_checkpointing import CheckpointManager

pytestmark = pytest.mark.multirank
WORLD = 2
# The save's timeout: what rank 1's writer waited before (at least), and so the bound of "at once" (it was half
# of 10 s, for a whole save, a writer's death and its answer, which a busy 2-core machine could exceed).
WAIT_S = 20


def _outcome(future: Any) -> str:
    return shared.outcome(future, WAIT_S * 4)


def _rank_0s_writer_killed(
    manager: CheckpointManager, root: str, control: Control, moment: str, step: int, out: dict[str, Any]
) -> None:
    """Save `ck` again; rank 0's writer blocks at `moment` of its commit, and rank 0's trainer SIGKILLs it."""
    rank = dist.get_rank()
    wait_for_the_writer(manager)  # a killed writer's replacement: its start is not the save's time
    if rank == 0:
        control.block(moment)
    dist.barrier()
    pid = None
    started = time.monotonic()
    future = manager.save(f"{root}/ck", shared.state(step, rank))
    if rank == 0:
        pid = control.wait_blocked(WAIT_S * 3)  # the blocked process: rank 0's writer
        assert pid == manager.writer_pid, (pid, manager.writer_pid)
        os.kill(pid, signal.SIGKILL)
        control.reset()
    said = {"outcome": _outcome(future), "s": time.monotonic() - started, "pid": pid}
    dist.barrier()
    said["loaded"] = shared.loaded(manager, f"{root}/ck")
    said["entries"] = sorted(p.name for p in Path(root).iterdir())
    out[moment] = said


def rank_0s_writer_dies_in_the_commit(root: str, control_root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    control = Control(f"{control_root}/{rank}")
    manager, warnings = shared.async_manager(str(control.root), WAIT_S)
    out: dict[str, Any] = {"rank": rank}
    out["first"] = _outcome(manager.save(f"{root}/ck", shared.state(1, rank)))
    _rank_0s_writer_killed(manager, root, control, "manifest", 2, out)
    _rank_0s_writer_killed(manager, root, control, "before rmdir", 3, out)
    return shared.after_and_close(manager, warnings, root, rank, out, WAIT_S * 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return shared.launch_job(rank_0s_writer_dies_in_the_commit, WORLD, tmp_path_factory.mktemp("round22"), timeout=300)


def test_rank_0s_writer_killed_before_the_swap_fails_every_rank_alike_at_once(results: list[dict[str, Any]]) -> None:
    said = [r["manifest"] for r in results]
    assert [r["first"] for r in results] == ["ok", "ok"], results
    assert said[0]["outcome"] == said[1]["outcome"], said
    assert said[0]["outcome"].startswith("CommitError:"), said
    assert "rank(s) [0]" in said[0]["outcome"] and "Nothing was committed" in said[0]["outcome"], said
    for r in results:
        assert r["manifest"]["s"] < WAIT_S, said
        assert r["manifest"]["loaded"] == 10.0 + r["rank"], r  # the earlier checkpoint, intact
        assert r["manifest"]["entries"] == ["ck"], r  # nothing of the failed save left beside it


def test_rank_0s_writer_killed_after_the_swap_is_a_committed_save_on_every_rank(results: list[dict[str, Any]]) -> None:
    said = [r["before rmdir"] for r in results]
    assert [s["outcome"] for s in said] == ["ok", "ok"], said
    for r in results:
        done = r["before rmdir"]
        assert done["s"] < WAIT_S, said
        assert done["loaded"] == 30.0 + r["rank"], r
        assert done["entries"] == ["ck"], r  # the replaced checkpoint (in the temporary name at the kill) was removed
        assert r["after"] == "ok" and r["after_loaded"] == 40.0 + r["rank"], r
    rank_0 = results[0]
    died = [w for w in rank_0["warnings"] if str(said[0]["pid"]) in w and "save is done" in w]
    assert died, rank_0["warnings"]
