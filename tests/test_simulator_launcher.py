"""The shared launcher: real gloo ranks, rank-ordered results, bounded failures."""

from __future__ import annotations

import time

import pytest

from simulator import probes
from simulator.launcher import LaunchError, launch

pytestmark = pytest.mark.multirank


def test_results_come_back_in_rank_order_over_a_working_process_group() -> None:
    lines: list[str] = []
    results = launch(probes.rank_and_sum, 3, timeout=90, progress=lines.append)
    assert results == [(0, 3, 3.0), (1, 3, 3.0), (2, 3, 3.0)]
    assert sorted(lines) == ["rank 0 reduced", "rank 1 reduced", "rank 2 reduced"]


def test_rendezvous_env_is_loopback_and_caller_env_reaches_ranks() -> None:
    assert launch(probes.env_value, 2, args=("MASTER_ADDR",), timeout=90) == ["127.0.0.1", "127.0.0.1"]
    got = launch(probes.env_value, 2, args=("SIM_TEST_FLAG",), timeout=90, env={"SIM_TEST_FLAG": "on"})
    assert got == ["on", "on"]


def test_a_raising_rank_is_named_with_its_exception_and_log_lines() -> None:
    with pytest.raises(LaunchError) as info:
        launch(probes.crash_on, 2, args=(1, "deliberate failure 42"), timeout=90)
    text = str(info.value)
    assert "rank 1: raised RuntimeError: deliberate failure 42" in text
    assert "about to fail on rank 1" in text
    assert [f.rank for f in info.value.failures] == [1]


def test_the_rank_that_failed_first_is_blamed_not_the_ranks_its_death_broke() -> None:
    """Issue 16: rank 1 raised, rank 0 died in a barrier; the report named only rank 0's gloo error."""
    for _ in range(2):  # the old launcher blamed rank 0 in most runs: twice in a row must both be right
        with pytest.raises(LaunchError) as info:
            launch(probes.fail_while_others_wait, 2, args=(1, "boom on rank 1"), timeout=90)
        _assert_rank_1_blamed(info.value)
        assert [f.rank for f in info.value.failures] == [1, 0], "rank 0's broken barrier is listed after rank 1"


def test_a_culprit_that_broke_the_links_before_raising_is_still_blamed() -> None:
    """Deterministic: rank 0 fails (connection closed) a second before rank 1 raises its ValueError."""
    with pytest.raises(LaunchError) as info:
        launch(probes.break_links_then_fail, 2, args=(1, "boom on rank 1", 1.0), timeout=90)
    _assert_rank_1_blamed(info.value)
    assert "consequence" in info.value.failures[1].cause


def _assert_rank_1_blamed(error: LaunchError) -> None:
    text = str(error)
    assert error.failures[0].rank == 1, text
    assert "rank 1: raised ValueError: boom on rank 1" in text
    assert text.splitlines()[0].startswith("simulator: rank 1 failed"), text
    for later in error.failures[1:]:
        assert "as a consequence of rank 1" in later.cause, text


def test_a_hard_exit_is_reported_with_its_exit_code() -> None:
    with pytest.raises(LaunchError) as info:
        launch(probes.exit_on, 2, args=(0, 7), timeout=90)
    assert "rank 0: exited with code 7" in str(info.value)
    assert "exiting hard on rank 0" in str(info.value)


def test_a_hung_rank_ends_the_run_at_the_timeout_instead_of_hanging() -> None:
    # Long enough for both ranks to reach hang_on first: starting them took up to 12.5 s under coverage on two
    # busy cores. The hung rank sleeps an hour.
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(probes.hang_on, 2, args=(1,), timeout=30)
    assert time.monotonic() - start < 60
    first = info.value.failures[0]
    assert first.rank == 1 and first.cause == "timed out after 30s"
    assert "rank 1 hanging now" in first.log_tail
    assert "waiting for the others" in info.value.failures[1].cause


@pytest.mark.parametrize("bad", [lambda: 1])
def test_unimportable_functions_are_refused_before_spawning(bad: object) -> None:
    with pytest.raises(ValueError, match="module-level"):
        launch(bad, 2)  # type: ignore[arg-type]


def test_bad_world_size_and_timeout_are_refused() -> None:
    with pytest.raises(ValueError, match="world_size"):
        launch(probes.rank_and_sum, 0)
    with pytest.raises(ValueError, match="timeout"):
        launch(probes.rank_and_sum, 1, timeout=0)
