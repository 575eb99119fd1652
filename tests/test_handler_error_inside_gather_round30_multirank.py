"""A signal handler's own exception held inside torch's `all_gather_object` is raised as itself (two real gloo
ranks, one launch; round 30).

Round 29 holds a signal that lands in the ranks' exchange of answers until the exchange is done, and runs its
handler at the end of the hold. The hold sat inside the exchange's `except Exception`, which takes any exception
for gloo's word that a peer died: a handler raising anything but a KeyboardInterrupt or SystemExit (SIGALRM's
TimeoutError, a program's bound on the call; a preemption handler's own error) was raised as "rank 1 lost
contact with its peers (<the handler's words>); a rank died, hung, or never called save()", `from None`: the
handler's exception gone, a healthy group called broken. The signal here is a real SIGALRM, sent on rank 1
between the exchange's two gathers.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d

from tests.async_multirank_support import launch_job, loaded, state
from tests.test_interrupt_inside_gather_round29_multirank import _manager, _said

pytestmark = pytest.mark.multirank
CALLS = ["load", "save"]


def _alarm_between_gathers() -> None:
    """Once the next `all_gather_object`'s size gather has returned on this rank: a real SIGALRM, whose handler
    raises TimeoutError, then a second in which the handler runs, unless the exchange holds it."""
    real = distributed_c10d.all_gather

    def gathered(*args: Any, **kwargs: Any) -> Any:
        distributed_c10d.all_gather = real  # once: the size gather
        work = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGALRM)
        time.sleep(1.0)
        return work

    distributed_c10d.all_gather = gathered


def _timed_out(signum: int, frame: Any) -> None:
    raise TimeoutError("the call took too long")


def _job(root: str, control_dir: str) -> dict[str, Any]:
    rank, out = dist.get_rank(), {}
    signal.signal(signal.SIGALRM, _timed_out)
    manager = _manager()
    manager.save(f"{root}/ck", state(1, rank))
    calls = {
        "load": lambda: manager.load(f"{root}/ck", {"model": {"w": state(0, 0)["model"]["w"]}}),
        "save": lambda: manager.save(f"{root}/ck2", state(2, rank)),
    }
    for name, call in calls.items():
        dist.barrier()
        if rank == 1:
            _alarm_between_gathers()
        out[name] = _said(call)
        dist.barrier()
        out[f"{name}_then"] = loaded(manager, f"{root}/ck")
    out["closed"] = _said(manager.close)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_job(_job, 2, Path(tmp_path_factory.mktemp("handler_error_gather")), timeout=600)


@pytest.mark.parametrize("call", CALLS)
def test_the_handlers_exception_is_raised_as_itself(ranks: list[dict[str, Any]], call: str) -> None:
    """Defect: "CommitError: ...: rank 1 lost contact with its peers (the call took too long) ..."."""
    assert ranks[1][call].startswith("TimeoutError: the call took too long"), ranks


@pytest.mark.parametrize("call", CALLS)
def test_rank_0_hears_of_it_and_the_ranks_go_on_together(ranks: list[dict[str, Any]], call: str) -> None:
    said = ranks[0][call]
    assert "went silent" not in said and "rank 1: TimeoutError" in said, ranks
    assert [r[f"{call}_then"] for r in ranks] == [10.0, 11.0], ranks
