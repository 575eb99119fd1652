"""Ctrl-C on rank 1 in the moment after a collective step's answers were exchanged over the manager's gloo group,
before it went on to the next step (two real gloo ranks, one launch; round 28).

A collective load is three agreed steps (checking, custom resharders, restoring), a save's plan two (the plan,
then the target and metadata). Rank 1, interrupted once every rank's answer to one of them was in, left without
answering the next: rank 0 went on to it and waited the gloo group's whole timeout (save.wait_timeout_secs),
then the roll call's grace, and raised that rank 1 "went silent: it died, hung, or never made this call", of a
rank that had said why it left. Now a rank that leaves between two agreed steps answers the next one with why,
so rank 0 raises at once naming rank 1's KeyboardInterrupt, and the group stays in step for the next call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.async_multirank_support import launch_job, loaded, local_sync_manager, said, state
from tests.sigint_at import sigint_at
from torch_checkpointing import agreement, checkpoint_writer

pytestmark = pytest.mark.multirank
TIMEOUT_S = 20  # save.wait_timeout_secs: the gloo group's timeout, what rank 0 waited for the unanswered step
# Interrupted after: a load's check, a save's plan, the save's target step; as the sync save's write begins.
CALLS = ["load", "save", "written", "writing"]
HANG_S = 120  # what the interrupted rank's own wait is bounded by: the SIGINT ends it at once


def _arm(step_end: str) -> None:
    """A real SIGINT once this rank's first exchange of a step ending in `step_end` completes (every rank's answer
    in, every rank in the same call), before the exchange returns; for "": as the sync save's write begins (the
    plan agreed), before this rank's files step."""
    if step_end == "":
        sigint_at(checkpoint_writer, "Commit", HANG_S)
        return
    ends = lambda step, calls: step.endswith(step_end)  # noqa: E731
    sigint_at(agreement, "_refuse_other_calls", HANG_S, when=ends, after=True)


def _job(root: str, control_dir: str) -> dict[str, Any]:
    rank, out = dist.get_rank(), {}
    manager = local_sync_manager(TIMEOUT_S)
    manager.save(f"{root}/ck", state(1, rank))
    for name, step_end, call in (
        ("load", ": checking", lambda: manager.load(f"{root}/ck", {"model": {"w": state(0, 0)["model"]["w"]}})),
        ("save", "the plan", lambda: manager.save(f"{root}/ck2", state(2, rank))),
        ("written", "building the metadata", lambda: manager.save(f"{root}/ck3", state(3, rank))),
        ("writing", "", lambda: manager.save(f"{root}/ck5", state(5, rank))),
    ):
        dist.barrier()
        if rank == 1:
            _arm(step_end)
        out[name] = said(call)
        dist.barrier()
        out[f"{name}_then"] = loaded(manager, f"{root}/ck")  # the group is still in step: a load together works
    out["saved_then"] = said(lambda: manager.save(f"{root}/ck4", state(4, rank)))  # so are the saves' numbers
    manager.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_job(_job, 2, Path(tmp_path_factory.mktemp("left_between_steps")), timeout=600)


@pytest.mark.parametrize("call", CALLS)
def test_the_interrupted_rank_raises_its_interrupt(ranks: list[dict[str, Any]], call: str) -> None:
    assert ranks[1][call].startswith("KeyboardInterrupt"), ranks


@pytest.mark.parametrize("call", CALLS)
def test_rank_0_hears_of_the_interrupt_instead_of_calling_rank_1_silent(ranks: list[dict[str, Any]], call: str) -> None:
    said = ranks[0][call]
    # Before, after the whole timeout: "... rank(s) [1] went silent: it died, hung, or never made this call ..."
    # (load, save), "... rank(s) [1] did not report its answer to '...: writing the files' within 20s" (written).
    assert "went silent" not in said and "did not report" not in said, ranks
    words = "rank 1: KeyboardInterrupt" if call in ("load", "save") else "interrupted on rank 1 (KeyboardInterrupt"
    assert words in said, ranks


@pytest.mark.parametrize("call", CALLS)
def test_the_ranks_load_together_afterwards(ranks: list[dict[str, Any]], call: str) -> None:
    assert [r[f"{call}_then"] for r in ranks] == [10.0, 11.0], ranks


def test_the_ranks_save_together_afterwards(ranks: list[dict[str, Any]]) -> None:
    assert [r["saved_then"] for r in ranks] == ["ok", "ok"], ranks
