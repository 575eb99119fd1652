"""Ctrl-C on rank 1 in the moment after a collective step's answers were exchanged over the manager's gloo group,
before it went on to the next step (two real gloo ranks, one launch; round 28).

A collective load is three agreed steps (checking, custom resharders, restoring), a save's plan two (the plan,
then the target and metadata). Rank 1, interrupted once every rank's answer to one of them was in, left without
answering the next: rank 0 went on to it and waited the gloo group's whole timeout (save.wait_timeout_secs),
then the roll call's grace, and raised that rank 1 "went silent: it died, hung, or never made this call", of a
rank that had said why it left. Now a rank that leaves between two agreed steps answers the next one with why,
so rank 0 raises at once naming rank 1's KeyboardInterrupt, and the group stays in step for the next call.

The ranks' job is the "between" part of the one launch in tests/interrupted_rank_jobs.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interrupted_rank_jobs import BETWEEN_CALLS, interrupted_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return interrupted_ranks("between", tmp_path_factory)


@pytest.mark.parametrize("call", BETWEEN_CALLS)
def test_the_interrupted_rank_raises_its_interrupt(ranks: list[dict[str, Any]], call: str) -> None:
    assert ranks[1][call].startswith("KeyboardInterrupt"), ranks


@pytest.mark.parametrize("call", BETWEEN_CALLS)
def test_rank_0_hears_of_the_interrupt_instead_of_calling_rank_1_silent(ranks: list[dict[str, Any]], call: str) -> None:
    said = ranks[0][call]
    # Before, after the whole timeout: "... rank(s) [1] went silent: it died, hung, or never made this call ..."
    # (load, save), "... rank(s) [1] did not report its answer to '...: writing the files' within 20s" (written).
    assert "went silent" not in said and "did not report" not in said, ranks
    words = "rank 1: KeyboardInterrupt" if call in ("load", "save") else "interrupted on rank 1 (KeyboardInterrupt"
    assert words in said, ranks


@pytest.mark.parametrize("call", BETWEEN_CALLS)
def test_the_ranks_load_together_afterwards(ranks: list[dict[str, Any]], call: str) -> None:
    assert [r[f"{call}_then"] for r in ranks] == [10.0, 11.0], ranks


def test_the_ranks_save_together_afterwards(ranks: list[dict[str, Any]]) -> None:
    assert [r["saved_then"] for r in ranks] == ["ok", "ok"], ranks
