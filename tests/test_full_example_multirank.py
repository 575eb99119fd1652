"""The Full Config example across world sizes: 4 ranks save, 8 load (and save again), 3 load that."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.launcher import launch
from tests import full_example_jobs as jobs

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("full")
    first, second = str(root / "w4"), str(root / "w8")
    saved = launch(jobs.save_job, 4, args=(first, 0), timeout=300)
    on_eight = launch(jobs.load_then_save_job, 8, args=(first, 4, second), timeout=400)
    on_three = launch(jobs.load_job, 3, args=(second, 1, 8), timeout=300)
    return {"saved": saved[0], "on_eight": on_eight, "on_three": on_three, "root": root}


def test_four_rank_checkpoint_has_the_documented_files(runs: dict[str, Any]) -> None:
    names = set(runs["saved"])
    assert {f"model_{r}.pt" for r in range(4)} <= names
    assert {f"optimizer_{r}.pt" for r in range(4)} <= names
    assert {f"dataloader_{r}.pt" for r in range(4)} <= names
    assert {f"misc_state_{r}.json" for r in range(4)} <= names
    assert {"manifest.json", "metadata.json"} <= names


@pytest.mark.parametrize("run", ["on_eight", "on_three"])
def test_model_and_optimizer_reshard_bit_exact_in_place(runs: dict[str, Any], run: str) -> None:
    for r in runs[run]:
        assert r["model_exact"], f"rank {r['rank']}: model shard differs from the ground truth"
        assert r["model_in_place"], f"rank {r['rank']}: template tensors were replaced, not filled"
        assert r["optimizer_exact"], f"rank {r['rank']}: optimizer state differs"
        assert r["step"] == 7.0


@pytest.mark.parametrize("run", ["on_eight", "on_three"])
def test_custom_resharder_redistributes_dataloader_progress(runs: dict[str, Any], run: str) -> None:
    for r in runs[run]:
        assert r["consumed"] == r["consumed_expected"], r
    assert sum(r["consumed"] for r in runs[run]) == sum(
        jobs.consumed_on(k) for k in range(4 if run == "on_eight" else 8)
    )


def test_misc_state_is_each_ranks_own_copy_where_it_has_one(runs: dict[str, Any]) -> None:
    for r in runs["on_eight"]:
        if r["rank"] < 4:
            assert r["misc_state"] == {"step": 7, "rank": r["rank"]}
        else:
            assert r["misc_state"] is None, "a rank without a copy must not get another rank's"
