"""Rank 0 (the host of the checkpoint store) SIGKILLed or SIGSTOPped right after an async save's plan, before
the other ranks' writers reach its store (three real gloo ranks, spawned here: `simulator.launcher.launch`
stops every rank once one dies; round 24).

Ranks 1 and 2 raised the same error, but late: each writer found rank 0's store gone (its kept client failed at
once) or silent (unanswered within the save's timeout), and answered its trainer; the trainer then connected to
the store again to tell the other ranks, as if its writer had never reached the agreement: a refused connect
retried for the client's whole timeout (twice the save's: 12 s of a 6 s timeout, where the writer had taken
1), an unanswered one waited twice the timeout more (24 s in all). A writer's `CommitError` is the outcome every
rank has, or says that rank 0's store is unreachable: there is nobody left to tell, and the trainer raises it at
once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.probes import children_import_from, published_store
from tests.test_multirank_round17 import _STORE_WAIT, REPO, WORLD

pytestmark = pytest.mark.multirank
TIMEOUT_S = 10  # save.wait_timeout_secs


def _rank(rank: int, root: str, out_dir: str, how: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    from tests.async_multirank_support import local_async_manager, state, timed
    from torch_checkpointing import checkpoint_manager as cm

    dist.init_process_group(
        "gloo", store=published_store(rank, WORLD, out_dir, _STORE_WAIT), rank=rank, world_size=WORLD
    )
    manager = local_async_manager(TIMEOUT_S)
    out: dict[str, Any] = {"warm": timed(lambda: manager.save(f"{root}/warm", state(0, rank)).result(60))}
    dist.barrier()
    if rank == 0:
        planned = cm.agree

        def then_gone(step: str, *args: Any, **kwargs: Any) -> Any:
            agreed = planned(step, *args, **kwargs)
            if "building the metadata" in step:  # the plan's last step: the others go on to their writers
                os.kill(os.getpid(), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            return agreed

        cm.agree = then_gone  # type: ignore[assignment]
    out["gone"] = timed(lambda: manager.save(f"{root}/gone", state(1, rank)).result(120))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    os._exit(0)  # the default group lost rank 0: no clean teardown to wait for


def _launch(root: Path, how: str) -> dict[int, dict[str, Any]]:
    out_dir = root / "out"
    out_dir.mkdir()
    procs = [
        mp.get_context("spawn").Process(target=_rank, args=(r, str(root), str(out_dir), how)) for r in range(WORLD)
    ]
    with children_import_from(REPO):
        for p in procs:
            p.start()
    deadline = time.monotonic() + 200
    try:
        for p in procs[1:]:  # rank 0 is killed, or stays stopped until killed below
            p.join(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    return {
        r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in (1, 2) if (out_dir / f"rank{r}.json").exists()
    }


@pytest.mark.parametrize(
    ("how", "said", "bound_s"),
    [
        ("killed", "CommitError: Checkpoint commit: lost contact with rank 0", 1.5 * TIMEOUT_S),
        ("stopped", "CommitOutcomeUnknownError: Checkpoint commit: rank 0, which hosts", 2.2 * TIMEOUT_S),
    ],
)
def test_the_other_ranks_raise_one_error_naming_rank_0_without_a_second_wait(
    tmp_path: Path, how: str, said: str, bound_s: float
) -> None:
    got = _launch(tmp_path, how)
    results = [got[r]["gone"] for r in (1, 2)]
    assert all(got[r]["warm"]["result"] == "ok" for r in (1, 2)), got
    assert results[0]["result"] == results[1]["result"], results
    assert results[0]["result"].startswith(said), results
    # Each bound lies about halfway between the waits the save has now and the second wait it had before. Killed:
    # now none (0.03 s), before the client's connect for twice the timeout. Stopped: now the writer's wait of the
    # timeout and a grace (12 s), before twice the timeout more (32 s). `2 * TIMEOUT_S + 3` with TIMEOUT_S = 6 left
    # 7 s over the stopped case's own 8 s, which a busy machine took.
    assert all(one["elapsed"] < bound_s for one in results), results
    assert not (tmp_path / "gone").exists()
