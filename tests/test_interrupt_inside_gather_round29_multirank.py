"""A real SIGINT on rank 1 inside torch's `dist.all_gather_object`, between its gather of every rank's size and
its gather of the data (two real gloo ranks, one launch; round 29).

Before, the KeyboardInterrupt was raised there: rank 1 left in the middle of one collective, and rank 0 waited in
the data gather for the group's whole timeout, then raised that rank 1 "went silent". Now the interrupt is held
until the exchange is done (bounded by the group's timeout): rank 1 raises it between two agreed steps, answers
the next one with it, and rank 0 raises at once naming rank 1's KeyboardInterrupt; the group stays in step. A
second SIGINT inside the exchange still runs its handler at once (the way out of an exchange that hangs).

The ranks' job is the "inside" part of the one launch in tests/interrupted_rank_jobs.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interrupted_rank_jobs import INSIDE_CALLS, interrupted_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return interrupted_ranks("inside", tmp_path_factory)


@pytest.mark.parametrize("call", INSIDE_CALLS)
def test_the_interrupted_rank_raises_its_interrupt(ranks: list[dict[str, Any]], call: str) -> None:
    assert ranks[1][call].startswith("KeyboardInterrupt"), ranks


@pytest.mark.parametrize("call", INSIDE_CALLS)
def test_rank_0_hears_of_the_interrupt_instead_of_calling_rank_1_silent(ranks: list[dict[str, Any]], call: str) -> None:
    said = ranks[0][call]
    # Before, after the group's whole timeout: "... rank(s) [1] went silent: it died, hung, or never made this call"
    assert "went silent" not in said and "rank 1: KeyboardInterrupt" in said, ranks


@pytest.mark.parametrize("call", INSIDE_CALLS)
def test_the_ranks_load_together_afterwards(ranks: list[dict[str, Any]], call: str) -> None:
    assert [r[f"{call}_then"] for r in ranks] == [10.0, 11.0], ranks


def test_rank_1_hears_of_an_interrupt_on_rank_0(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["load0"].startswith("KeyboardInterrupt"), ranks
    assert "went silent" not in ranks[1]["load0"] and "rank 0: KeyboardInterrupt" in ranks[1]["load0"], ranks
    assert [r["load0_then"] for r in ranks] == [10.0, 11.0], ranks


def test_the_held_interrupt_is_said(ranks: list[dict[str, Any]]) -> None:
    """Round 31: the WARNING said "send it again to run it now", untrue while the rank waits inside gloo's C++
    gather (no Python handler runs there); it says when a second signal is acted on."""
    held = [line for line in ranks[1]["warnings"] if "during the exchange of answers with the other ranks" in line]
    assert len(held) == 3, ranks[1]["warnings"]
    assert all("run it now" not in line for line in held), held
    assert "sent again, it is acted on when this rank's wait in the gather returns" in held[0], held
    assert "the process group's timeout ends" in held[0], held


def test_a_second_sigint_runs_its_handler_at_once(ranks: list[dict[str, Any]]) -> None:
    # Held twice, rank 1 would have slept HANG_S and then raised; the launch would have outlived its timeout.
    assert ranks[1]["twice"].startswith("KeyboardInterrupt"), ranks
    assert any("again: its handler runs now" in line for line in ranks[1]["warnings"]), ranks[1]["warnings"]
