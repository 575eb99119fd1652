"""Rank functions for the benchmark tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

from benchmarks import ranks
from benchmarks.config import BenchConfig


def ranks_rank_run_counting_states(cfg: BenchConfig, root: str, runs: int) -> dict[str, Any]:
    """`benchmarks.ranks.rank_run`, recording (size, seed) of every synthetic state this rank builds."""
    real = ranks.make_state
    seeds: list[tuple[int, int]] = []

    def counting(total_bytes: int, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
        seeds.append((total_bytes, seed))
        return real(total_bytes, seed=seed, device=device)

    ranks.make_state = counting  # type: ignore[assignment]
    try:
        out = ranks.rank_run(cfg, root, runs)
    finally:
        ranks.make_state = real  # type: ignore[assignment]
    return {**out, "state_seeds": seeds}
