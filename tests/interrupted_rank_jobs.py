"""One launch of two real gloo ranks for the tests of a rank interrupted by a real SIGINT inside a collective call
(rounds 28 and 29). Each part is one test file's job, run in turn on the same ranks, each with a manager (and so
a gloo group and timeout) of its own; `interrupted_ranks(part)` launches the whole job once for all the files a
test session runs, and each file checks its part:

* "between" (test_left_between_collective_steps_round28_multirank): rank 1 interrupted between two agreed steps
  of a load or a save, or as a sync save's write begins;
* "told" (test_interrupted_load_told_round29_multirank): rank 1 interrupted at each point of a load;
* "handler_error" (test_handler_error_inside_gather_round30_multirank): on rank 1, a real SIGALRM whose handler
  raises TimeoutError, between the two gathers of torch's `all_gather_object`;
* "inside" (test_interrupt_inside_gather_round29_multirank): a rank interrupted inside torch's
  `all_gather_object`, between its two gathers. Last: its "twice" call leaves the group broken in a collective.

The ranks import this module by name (spawned), so everything here is a plain module-level name.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from tests.async_multirank_support import WarningLines, launch_job, loaded, local_sync_manager, said, state
from tests.sigint_at import disarm, sigint_at
from torch_checkpointing import agreement, checkpoint_loader, checkpoint_writer

__all__ = ["BETWEEN_CALLS", "HANDLER_ERROR_CALLS", "INSIDE_CALLS", "TOLD_POINTS", "interrupted_ranks"]

HANG_S = 120  # a wait a SIGINT run at once ends (the interrupted rank's own): the launch's timeout bounds it
LAUNCH_TIMEOUT_S = 900  # the three parts' launches took 600 each

# "between": interrupted after a load's check, a save's plan, the save's target step; as the sync save's write begins
BETWEEN_CALLS = ["load", "save", "written", "writing"]
BETWEEN_TIMEOUT_S = 20  # save.wait_timeout_secs: the gloo group's timeout, what rank 0 waited for the unanswered step
TOLD_POINTS = ["check", "copy", "after"]
TOLD_TIMEOUT_S = 20  # save.wait_timeout_secs: the gloo group's timeout
HANDLER_ERROR_CALLS = ["load", "save"]
HANDLER_ERROR_TIMEOUT_S = 10  # save.wait_timeout_secs: the gloo group's timeout
INSIDE_CALLS = ["load", "save"]
INSIDE_TIMEOUT_S = 10  # save.wait_timeout_secs: the gloo group's timeout, what rank 0 waited for the data gather

_LAUNCHED: list[list[dict[str, Any]]] = []


def interrupted_ranks(part: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What `part` of the job gave on each rank, in rank order; the job is launched once for the session."""
    if not _LAUNCHED:
        tmp = tmp_path_factory.mktemp("interrupted_ranks")
        _LAUNCHED.append(launch_job(_job, 2, tmp, timeout=LAUNCH_TIMEOUT_S))
    ranks = _LAUNCHED[0]
    assert all(part in r for r in ranks), [r.get(f"{part} failed", r) for r in ranks]
    return [r[part] for r in ranks]


def _job(root: str, control_dir: str) -> dict[str, Any]:
    parts: dict[str, Callable[[str], dict[str, Any]]] = {
        "between": _between,
        "told": _told,
        "handler_error": _handler_error,
        "inside": _inside,
    }
    out: dict[str, Any] = {}
    for part, run in parts.items():
        os.makedirs(f"{root}/{part}", exist_ok=True)
        dist.barrier()
        try:
            out[part] = run(f"{root}/{part}")
        except BaseException:  # said in place of the part's outcome; the next part's barrier may not meet
            out[f"{part} failed"] = traceback.format_exc()
        finally:  # a SIGINT armed for a call the part never reached would land in the next part
            disarm()
    return out


def _between(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    manager = local_sync_manager(BETWEEN_TIMEOUT_S)
    manager.save(f"{root}/ck", state(1, rank))
    for name, step_end, call in (
        ("load", ": checking", lambda: manager.load(f"{root}/ck", {"model": {"w": state(0, 0)["model"]["w"]}})),
        ("save", "the plan", lambda: manager.save(f"{root}/ck2", state(2, rank))),
        ("written", "building the metadata", lambda: manager.save(f"{root}/ck3", state(3, rank))),
        ("writing", "", lambda: manager.save(f"{root}/ck5", state(5, rank))),
    ):
        dist.barrier()
        if rank == 1:
            _arm_between(step_end)
        out[name] = said(call)
        dist.barrier()
        out[f"{name}_then"] = loaded(manager, f"{root}/ck")  # the group is still in step: a load together works
    out["saved_then"] = said(lambda: manager.save(f"{root}/ck4", state(4, rank)))  # so are the saves' numbers
    manager.close()
    return out


def _arm_between(step_end: str) -> None:
    """A real SIGINT once this rank's first exchange of a step ending in `step_end` completes (every rank's answer
    in, every rank in the same call), before the exchange returns; for "": as the sync save's write begins (the
    plan agreed), before this rank's files step."""
    if step_end == "":
        sigint_at(checkpoint_writer, "Commit", HANG_S)
        return
    ends = lambda step, calls: step.endswith(step_end)  # noqa: E731
    sigint_at(agreement, "_refuse_other_calls", HANG_S, when=ends, after=True)


def _told(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    manager = local_sync_manager(TOLD_TIMEOUT_S)
    warnings = WarningLines()
    logging.getLogger("torch_checkpointing").addHandler(warnings)
    manager.save(f"{root}/ck", state(1, rank))
    for point in TOLD_POINTS:
        dist.barrier()
        if rank == 1:
            _arm_told(point)
        into = {"model": {"w": torch.zeros(4)}}
        out[point] = said(lambda: manager.load(f"{root}/ck", into), notes=True)  # noqa: B023
        out[f"{point}_held"] = float(into["model"]["w"][0])
        dist.barrier()
        out[f"{point}_then"] = loaded(manager, f"{root}/ck")
    manager.close()
    logging.getLogger("torch_checkpointing").removeHandler(warnings)
    out["warnings"] = warnings.lines
    return out


def _arm_told(point: str) -> None:
    """A real SIGINT as the load reaches `point`, before the call there runs."""
    if point == "check":
        sigint_at(checkpoint_loader, "check_shared_targets", HANG_S)
    elif point == "copy":  # held until the copy has finished: the wait runs to its end
        copying = lambda *a, **k: "unexpected" in k and not k.get("dry_run", False)  # noqa: E731
        sigint_at(checkpoint_loader, "walk_checkpoint_structure", 0.5, when=copying)
    else:
        sigint_at(checkpoint_loader.CheckedLoad, "close", HANG_S)


def _handler_error(root: str) -> dict[str, Any]:
    rank, out = dist.get_rank(), {}
    before = signal.signal(signal.SIGALRM, _timed_out)
    try:
        manager = local_sync_manager(HANDLER_ERROR_TIMEOUT_S)
        manager.save(f"{root}/ck", state(1, rank))
        calls = {
            "load": lambda: manager.load(f"{root}/ck", {"model": {"w": state(0, 0)["model"]["w"]}}),
            "save": lambda: manager.save(f"{root}/ck2", state(2, rank)),
        }
        for name, call in calls.items():
            dist.barrier()
            if rank == 1:
                _alarm_between_gathers()
            out[name] = said(call)
            dist.barrier()
            out[f"{name}_then"] = loaded(manager, f"{root}/ck")
        out["closed"] = said(manager.close)
    finally:
        signal.signal(signal.SIGALRM, before)
    return out


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


def _inside(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    manager = local_sync_manager(INSIDE_TIMEOUT_S)
    warnings = WarningLines()
    logging.getLogger("torch_checkpointing").addHandler(warnings)
    manager.save(f"{root}/ck", state(1, rank))
    calls = {
        "load": lambda: manager.load(f"{root}/ck", {"model": {"w": state(0, 0)["model"]["w"]}}),
        "save": lambda: manager.save(f"{root}/ck2", state(2, rank)),
        "load0": lambda: manager.load(f"{root}/ck", {"model": {"w": state(0, 0)["model"]["w"]}}),
        "twice": lambda: manager.load(f"{root}/ck", {"model": {"w": state(0, 0)["model"]["w"]}}),
    }
    for name, call in calls.items():
        dist.barrier()
        if rank == (0 if name == "load0" else 1):  # rank 0 hosts the store the roll call uses
            # once the next `all_gather_object`'s first gather (every rank's size) has returned on this rank
            times, wait_s = (2, HANG_S) if name == "twice" else (1, 1.0)
            sigint_at(distributed_c10d, "all_gather", wait_s, times=times, after=True)
        out[name] = said(call)
        if name != "twice":  # the group broke in the middle of a collective there
            dist.barrier()
            out[f"{name}_then"] = loaded(manager, f"{root}/ck")
    out["warnings"] = warnings.lines
    out["closed"] = said(manager.close)
    return out
