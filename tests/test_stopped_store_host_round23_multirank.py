"""Rank 0, which hosts the checkpoint store, stopped (SIGSTOP) in the middle of a save (three real gloo ranks,
one launch; round 23).

A TCPStore client waits for its host's reply without a timeout (the client's timeout applies only to waiting
for a key): with rank 0's trainer stopped, ranks 1 and 2 published their answers and then waited in the
store's `check` for as long as rank 0 stayed stopped; the save's timeout (6 s here) never fired. They returned
only once rank 0 was let go, after 60 s here, for good if it never is. Now every call on the store is bounded by
the save's timeout, and ranks 1 and 2 raise the same error, naming rank 0, within it; rank 0, let go, fails the
save too (where they had connected to its store before it stopped, their decision to give up reaches it, and it
raises their error), and nothing is committed.

A load with rank 0 stopped in its check: ranks 1 and 2 lose the gloo step, then report in on rank 0's store
(the roll call), which does not answer: they said rank 0 "went away (... it died or closed its manager)". Now
they say it did not answer (stopped, hung, or cut off), and no rank changed a template.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.async_multirank_support import timed
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank
WORLD = 3
TIMEOUT_S = 6  # save.wait_timeout_secs
STOPPED_S = 60  # rank 0 is let go once ranks 1 and 2 returned, or after this long
BOUND_S = 3 * TIMEOUT_S + 15


def _stop_in_write() -> None:
    """Rank 0 stops itself (its store with it) once the plan is agreed, as it starts writing its files."""
    from torch_checkpointing import checkpoint_writer

    write = checkpoint_writer._write_local_files

    def stopping(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGSTOP)
        return write(*args, **kwargs)

    checkpoint_writer._write_local_files = stopping  # type: ignore[assignment]


def _let_rank_0_go(root: Path) -> None:
    """(Rank 1's thread.) SIGCONT rank 0 once ranks 1 and 2 returned from their call, or after `STOPPED_S`."""
    pid = int((root / "pid_0").read_text())
    deadline = time.monotonic() + STOPPED_S
    while time.monotonic() < deadline and not all((root / f"returned_{r}").exists() for r in (1, 2)):
        time.sleep(0.1)
    os.kill(pid, signal.SIGCONT)


def _while_rank_0_is_stopped(root: Path, call: Any) -> dict[str, Any]:
    """`call()` on every rank, rank 1 letting rank 0 go once ranks 1 and 2 returned from it."""
    rank = dist.get_rank()
    if rank == 0:
        (root / "pid_0").write_text(str(os.getpid()))
    dist.barrier()
    if rank == 1:
        threading.Thread(target=_let_rank_0_go, args=(root,), daemon=True).start()
    out = timed(call)
    (root / f"returned_{rank}").touch()
    dist.barrier()  # the default group: rank 0 has been let go and has its own outcome
    for name in ("pid_0", f"returned_{rank}"):
        dist.barrier()
        (root / name).unlink(missing_ok=True)
    return out


def _job(root_text: str) -> dict[str, Any]:
    rank, root = dist.get_rank(), Path(root_text)
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = TIMEOUT_S
    manager = CheckpointManager(config)
    state = {"model": {"w": torch.full((8,), float(rank))}}
    manager.save(str(root / "before"), state)
    # 1. A save: rank 0 stops as it starts writing its files (the commit's steps go over its store).
    if rank == 0:
        _stop_in_write()
    out = _while_rank_0_is_stopped(root, lambda: manager.save(str(root / "stopped"), state))
    out["stopped_exists"] = (root / "stopped").exists()
    manager.close()
    # 2. A load: rank 0 stops in its check (the step goes over the gloo group; the roll call over its store).
    loader = CheckpointManager(config)
    template = {"model": {"w": torch.full((8,), -1.0)}}
    if rank == 0:
        check = loader._check_load

        def stopping(*args: Any, **kwargs: Any) -> Any:
            loader._check_load = check  # type: ignore[method-assign]  (once)
            os.kill(os.getpid(), signal.SIGSTOP)
            return check(*args, **kwargs)

        loader._check_load = stopping  # type: ignore[method-assign]
    out["load"] = _while_rank_0_is_stopped(root, lambda: loader.load(str(root / "before"), template))
    out["template"] = float(template["model"]["w"][0])
    loader.close()
    again = CheckpointManager(config)  # a new group: the stopped rank broke the old one's
    again.load(str(root / "before"), template)
    out["before_loaded"] = float(template["model"]["w"][0])
    again.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_job, WORLD, args=(str(tmp_path_factory.mktemp("stopped")),), timeout=300)


def test_the_other_ranks_give_up_within_the_timeout_with_one_error_naming_rank_0(ranks: list[dict[str, Any]]) -> None:
    got = [ranks[r] for r in (1, 2)]
    assert all(one["elapsed"] < BOUND_S for one in got), got  # before: until rank 0 was let go (60 s)
    assert got[0]["result"] == got[1]["result"], got
    assert got[0]["result"].startswith("CommitOutcomeUnknownError: ") and "rank 0" in got[0]["result"], got


def test_rank_0_let_go_fails_the_save_too_and_commits_nothing(ranks: list[dict[str, Any]]) -> None:
    # The same error as the others where they had connected to its store before it stopped (their decision to
    # give up reaches it once it runs again); else its own, that they did not report.
    assert ranks[0]["result"].startswith(("CommitError: ", "CommitOutcomeUnknownError: ")), ranks
    assert not any(out["stopped_exists"] for out in ranks), ranks
    assert [out["before_loaded"] for out in ranks] == [0.0, 1.0, 2.0], ranks  # the earlier checkpoint is whole


def test_a_load_with_rank_0_stopped_fails_the_others_in_time_naming_it_and_restores_nothing(
    ranks: list[dict[str, Any]],
) -> None:
    got = [ranks[r]["load"] for r in (1, 2)]
    assert all(one["elapsed"] < BOUND_S for one in got), got
    assert got[0]["result"] == got[1]["result"], got
    assert "rank 0: did not answer" in got[0]["result"], got  # before: "went away ... died or closed"
    assert ranks[0]["load"]["result"] != "ok", ranks  # rank 0, let go, fails its load too
    assert [out["template"] for out in ranks] == [-1.0] * WORLD, ranks  # no template changed on any rank
