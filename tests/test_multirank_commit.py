"""The multi-rank commit protocol on real gloo ranks: one atomic commit, failures named, collisions refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from simulator.launcher import launch
from tests import multirank_jobs

pytestmark = pytest.mark.multirank
WORLD = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("commit")
    return launch(multirank_jobs.commit_checks, WORLD, args=(str(root),), timeout=240)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_rank_sees_the_commit_when_its_save_returns(results: list[dict[str, Any]], mode: str) -> None:
    expected = sorted(
        ["manifest.json"] + [f"model_{r}.pt" for r in range(WORLD)] + [f"rank_{r}/misc.json" for r in range(WORLD)]
    )
    for r in results:
        assert r[f"{mode}_manifest_seen"], f"rank {r['rank']}: save returned before the commit"
        assert r[f"{mode}_files"] == expected
        assert r[f"{mode}_loaded_ok"], f"rank {r['rank']} did not read back its own shard"


def test_layout_without_rank_is_written_once_by_rank_0_and_read_by_all(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["fixed_files"] == ["manifest.json", "misc.json"]
        assert r["fixed_loaded"] == {"rank": 0}, "every rank reads the one copy, written by the lowest rank"
        warned = r["fixed_warned"]
        if r["rank"] == 0:
            assert any("misc.json" in w and "{rank}" in w for w in warned), warned
        else:
            assert not warned


def test_different_keys_on_one_path_across_ranks_are_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "a_0.json" in r["collision"] and "'a'" in r["collision"] and "'b'" in r["collision"], r["collision"]
        assert not r["collide_exists"]


def test_a_payload_refused_on_one_rank_is_refused_on_all(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert not r["refused_exists"]
        # The same CommitError on every rank, the refusing one included, naming it and its reason.
        assert r["refused"].startswith("CommitError:") and "rank(s) [1]" in r["refused"], r["refused"]
        assert "Invalid checkpoint keys ['not ok']" in r["refused"] and r["refused"] == results[0]["refused"]


def test_a_rank_that_never_writes_fails_the_save_everywhere_naming_it(results: list[dict[str, Any]]) -> None:
    for r in results:
        dead = r["dead"]
        assert not dead["exists"], "a partial checkpoint became visible"
        if r["rank"] != 1:
            assert "rank(s) [1]" in dead["error"], dead["error"]
        else:
            assert dead["blocked"], "rank 1's write never reached the blocking storage"


def test_manifest_records_world_size(results: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> None:
    import json

    root = Path(tmp_path_factory.getbasetemp()) / "commit0" / "commit" / "sync"
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["world_size"] == WORLD
    assert sorted(manifest["items"]["model"]) == [str(r) for r in range(WORLD)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_to_memory_on_several_ranks_is_refused_at_the_plan_naming_memory(
    results: list[dict[str, Any]], mode: str
) -> None:
    """`memory://` is one process's own: on several ranks each rank wrote its files into its own memory. Before,
    a sync save failed at the commit with a CommitError blaming "a node-local disk" and advising
    FsspecStorageConfig (which it was), and an async save blamed the writer process only. Now every rank refuses
    the plan, naming memory:// and what to use, before any rank writes a byte."""
    for r in results:
        said = r["process_local"][mode]
        assert said.startswith("CommitError (from ConfigError)"), said
        assert "memory://" in said and f"{WORLD} ranks" in said and "s3://" in said, said
        assert "node-local disk" not in said, said
        assert r["process_local"][f"{mode}_left"] == "False", r["process_local"]


def test_a_collective_load_from_memory_on_several_ranks_is_refused_alike_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    """`memory://` is one process's own, so each rank of a collective load read its own. Before, rank 0 (whose
    memory:// held a manifest) raised ForeignManifestError and rank 1 FileNotFoundError "does not exist": two
    stories for one load, neither naming the cause. Now every rank raises the same ConfigError, as the save's."""
    said = [r["process_local"]["load"] for r in results]
    assert len(set(said)) == 1, said
    assert said[0].startswith("ConfigError: "), said
    assert "memory://" in said[0] and f"{WORLD} ranks" in said[0] and "collective=False" in said[0], said
