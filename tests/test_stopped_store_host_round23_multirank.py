"""Rank 0, which hosts the checkpoint store, stopped (SIGSTOP) in the middle of a save (three real gloo ranks,
one launch; round 23).

A TCPStore client waits for its host's reply without a timeout (the client's timeout applies only to waiting
for a key): with rank 0's trainer stopped, ranks 1 and 2 published their answers and then waited in the
store's `check` for as long as rank 0 stayed stopped; the save's timeout (6 s here) never fired. They returned
only once rank 0 was let go, after 60 s here, for good if it never is. Now every call on the store is bounded by
the save's timeout, and ranks 1 and 2 raise the same error, naming rank 0, within it; their decision to give up
still reaches the store, so rank 0, let go, raises it too rather than commit alone.
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
    """(Rank 1's thread.) SIGCONT rank 0 once ranks 1 and 2 returned from their save, or after `STOPPED_S`."""
    pid = int((root / "pid_0").read_text())
    deadline = time.monotonic() + STOPPED_S
    while time.monotonic() < deadline and not all((root / f"returned_{r}").exists() for r in (1, 2)):
        time.sleep(0.1)
    (root / "continued").write_text(str(time.monotonic()))
    os.kill(pid, signal.SIGCONT)


def _job(root_text: str) -> dict[str, Any]:
    rank, root = dist.get_rank(), Path(root_text)
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = TIMEOUT_S
    manager = CheckpointManager(config)
    state = {"model": {"w": torch.full((8,), float(rank))}}
    manager.save(str(root / "before"), state)
    if rank == 0:
        (root / "pid_0").write_text(str(os.getpid()))
        _stop_in_write()
    dist.barrier()
    if rank == 1:
        threading.Thread(target=_let_rank_0_go, args=(root,), daemon=True).start()
    started = time.monotonic()
    try:
        manager.save(str(root / "stopped"), state)
        result = "ok"
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"
    out: dict[str, Any] = {"result": result, "elapsed": time.monotonic() - started}
    (root / f"returned_{rank}").touch()
    dist.barrier()  # the default group: rank 0 has been let go and has its own outcome
    out["stopped_exists"] = (root / "stopped").exists()
    template = {"model": {"w": torch.zeros(8)}}
    manager.load(str(root / "before"), template)
    out["before"] = float(template["model"]["w"][0])
    manager.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_job, WORLD, args=(str(tmp_path_factory.mktemp("stopped")),), timeout=300)


def test_the_other_ranks_give_up_within_the_timeout_with_one_error_naming_rank_0(ranks: list[dict[str, Any]]) -> None:
    got = [ranks[r] for r in (1, 2)]
    assert all(one["elapsed"] < BOUND_S for one in got), got  # before: until rank 0 was let go (60 s)
    assert got[0]["result"] == got[1]["result"], got
    assert got[0]["result"].startswith("CommitOutcomeUnknownError: ") and "rank 0" in got[0]["result"], got


def test_rank_0_let_go_raises_what_the_others_raised_and_commits_nothing(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["result"] == ranks[1]["result"], ranks
    assert not any(out["stopped_exists"] for out in ranks), ranks
    assert [out["before"] for out in ranks] == [0.0, 1.0, 2.0], ranks  # the earlier checkpoint is untouched
