"""A real SIGINT on rank 1 inside torch's `dist.all_gather_object`, between its gather of every rank's size and
its gather of the data (two real gloo ranks, one launch; round 29).

Before, the KeyboardInterrupt was raised there: rank 1 left in the middle of one collective, and rank 0 waited in
the data gather for the group's whole timeout, then raised that rank 1 "went silent". Now the interrupt is held
until the exchange is done (bounded by the group's timeout): rank 1 raises it between two agreed steps, answers
the next one with it, and rank 0 raises at once naming rank 1's KeyboardInterrupt; the group stays in step. A
second SIGINT inside the exchange still runs its handler at once (the way out of an exchange that hangs).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d

from tests.async_multirank_support import WarningLines, launch_job, loaded, local_sync_manager, said, state
from tests.sigint_at import sigint_at

pytestmark = pytest.mark.multirank
TIMEOUT_S = 10  # save.wait_timeout_secs: the gloo group's timeout, what rank 0 waited for the data gather
HANG_S = 120  # a wait a SIGINT run at once ends; the launch's timeout bounds it otherwise
CALLS = ["load", "save"]


def _job(root: str, control_dir: str) -> dict[str, Any]:
    rank, out = dist.get_rank(), {}
    manager = local_sync_manager(TIMEOUT_S)
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


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_job(_job, 2, Path(tmp_path_factory.mktemp("inside_gather")), timeout=600)


@pytest.mark.parametrize("call", CALLS)
def test_the_interrupted_rank_raises_its_interrupt(ranks: list[dict[str, Any]], call: str) -> None:
    assert ranks[1][call].startswith("KeyboardInterrupt"), ranks


@pytest.mark.parametrize("call", CALLS)
def test_rank_0_hears_of_the_interrupt_instead_of_calling_rank_1_silent(ranks: list[dict[str, Any]], call: str) -> None:
    said = ranks[0][call]
    # Before, after the group's whole timeout: "... rank(s) [1] went silent: it died, hung, or never made this call"
    assert "went silent" not in said and "rank 1: KeyboardInterrupt" in said, ranks


@pytest.mark.parametrize("call", CALLS)
def test_the_ranks_load_together_afterwards(ranks: list[dict[str, Any]], call: str) -> None:
    assert [r[f"{call}_then"] for r in ranks] == [10.0, 11.0], ranks


def test_rank_1_hears_of_an_interrupt_on_rank_0(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["load0"].startswith("KeyboardInterrupt"), ranks
    assert "went silent" not in ranks[1]["load0"] and "rank 0: KeyboardInterrupt" in ranks[1]["load0"], ranks
    assert [r["load0_then"] for r in ranks] == [10.0, 11.0], ranks


def test_the_held_interrupt_is_said(ranks: list[dict[str, Any]]) -> None:
    held = [line for line in ranks[1]["warnings"] if "during the exchange of answers with the other ranks" in line]
    assert len(held) == 3 and "send it again to run it now" in held[0], ranks[1]["warnings"]


def test_a_second_sigint_runs_its_handler_at_once(ranks: list[dict[str, Any]]) -> None:
    # Held twice, rank 1 would have slept HANG_S and then raised; the launch would have outlived its timeout.
    assert ranks[1]["twice"].startswith("KeyboardInterrupt"), ranks
    assert any("again: its handler runs now" in line for line in ranks[1]["warnings"]), ranks[1]["warnings"]
