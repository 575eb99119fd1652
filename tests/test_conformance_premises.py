"""Durability clauses measure what they state, or report that they did not: none holds by construction.

A kill, a full disk, a failing rank or a concurrent load during a save over a committed id shows nothing about
a backend that never replaces a checkpoint: it refuses the save, and the id holds the old checkpoint by
construction. The suite is run here as a user runs it (pytest in a subprocess, ``--backend``,
``--clause-report``) against backends that differ from ours only on a save over an existing id
(``tests/conformance_backends``): one that refuses it must come out *not measured*, with the refusal as the
reason, one that returns without replacing the id must fail, and ours must pass. Against a local S3 server
the same clauses are measured, not skipped as local-only: ours refuses to replace a checkpoint there
(docs/storage.md), and that refusal, not the storage, is what leaves them unmeasured.

Likewise a damaged copy that "raises" shows nothing when the backend loads nothing, and a save refused over an
unrelated directory shows nothing when the backend saves nothing: those clauses carry controls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.s3_server import S3Server

ROOT = Path(__file__).resolve().parent.parent
_RUN_TIMEOUT_S = 600
DURABILITY = "conformance/test_durability.py::"
KILL_SYNC = DURABILITY + "test_killed_save_leaves_old_or_new[sync]"
KILL_ASYNC = DURABILITY + "test_killed_save_leaves_old_or_new[async]"
KILL_RANKS = DURABILITY + "test_killed_two_rank_save_leaves_old_or_new"
CONCURRENT = DURABILITY + "test_load_during_overwrite_is_one_whole_checkpoint"
DISK_FULL = DURABILITY + "test_disk_full_fails_cleanly[sync]"
ONE_RANK = DURABILITY + "test_one_rank_raising_fails_every_rank"
REFUSES = "tests.conformance_backends.refuses_overwrite"
KEEPS_OLD = "tests.conformance_backends.keeps_old"
NEVER_LOADS = "tests.conformance_backends.never_loads"
NEVER_SAVES = "tests.conformance_backends.never_saves"
DAMAGE = [DURABILITY + t for t in ("test_truncation_is_detected", "test_deleted_file_is_detected")]
DAMAGE_CLAUSES = ["INTEG-TRUNC-1", "INTEG-DELETE-1", "SAFE-PICKLE-1"]
PICKLE = DURABILITY + "test_pickles_in_a_checkpoint_are_not_executed[pickle]"
FOREIGN_IDS = [
    DURABILITY + t for t in ("test_save_over_an_unrelated_directory_is_refused", "test_save_over_a_file_is_refused")
]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORMANCE_")}
    return {**env, "PYTHONPATH": path, **(extra or {})}


def _run_clauses(
    tmp_path: Path, tests: Sequence[str], options: Sequence[str] = (), env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """(the clause report, pytest's output) of the conformance tests ``tests`` run with ``options``."""
    report = tmp_path / f"clauses-{uuid.uuid4().hex[:6]}.json"
    basetemp = tmp_path / f"basetemp-{uuid.uuid4().hex[:6]}"
    flags = ["-q", "-n", "0", "-p", "no:cacheprovider", "--basetemp", str(basetemp), "--clause-report", str(report)]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *tests, *flags, *options],
        cwd=ROOT,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=_RUN_TIMEOUT_S,
    )
    out = done.stdout + done.stderr
    assert report.exists(), f"no clause report written (exit {done.returncode}):\n{out[-6000:]}"
    return json.loads(report.read_text()), out


def _assert_refusal_not_measured(result: dict[str, Any], clauses: Sequence[str], out: str) -> None:
    got = {c: result["clauses"].get(c) for c in clauses}
    assert got == dict.fromkeys(clauses, "not measured"), out[-6000:]
    for cid in clauses:
        reason = result["reasons"][cid]
        assert "refuses to replace a committed checkpoint" in reason and "FileExistsError" in reason, (cid, reason)


def test_a_backend_refusing_every_overwrite_leaves_the_overwrite_clauses_not_measured(tmp_path: Path) -> None:
    # The old harness wrapped each save over the id in suppress(Exception): all four passed here.
    result, out = _run_clauses(tmp_path, [KILL_SYNC, KILL_ASYNC, CONCURRENT, DISK_FULL], ["--backend", REFUSES])
    _assert_refusal_not_measured(result, ["DUR-KILL-1", "DUR-KILL-2", "DUR-CONC-1", "DUR-DISKFULL-1"], out)


@pytest.mark.multirank
def test_a_backend_refusing_every_overwrite_on_two_ranks_is_not_measured(tmp_path: Path) -> None:
    result, out = _run_clauses(tmp_path, [KILL_RANKS, ONE_RANK], ["--backend", REFUSES])
    _assert_refusal_not_measured(result, ["DUR-KILL-3", "DUR-RANK-1"], out)


def test_a_backend_whose_overwrite_keeps_the_old_checkpoint_fails(tmp_path: Path) -> None:
    """A save over the id that returns normally and changes nothing is a silent failure, not a pass."""
    result, out = _run_clauses(tmp_path, [KILL_SYNC, CONCURRENT, DISK_FULL], ["--backend", KEEPS_OLD])
    clauses = ["DUR-KILL-1", "DUR-CONC-1", "DUR-DISKFULL-1"]
    assert {c: result["clauses"].get(c) for c in clauses} == dict.fromkeys(clauses, "failed"), out[-6000:]
    assert "the id then loads 'old'" in result["reasons"]["DUR-KILL-1"], result["reasons"]
    assert "the save over the committed checkpoint raised nothing" in result["reasons"]["DUR-DISKFULL-1"]


@pytest.mark.multirank
def test_ours_replaces_the_id_and_passes_the_overwrite_clauses(tmp_path: Path) -> None:
    result, out = _run_clauses(tmp_path, [KILL_SYNC, CONCURRENT, DISK_FULL, ONE_RANK])
    clauses = ["DUR-KILL-1", "DUR-CONC-1", "DUR-DISKFULL-1", "DUR-RANK-1"]
    assert {c: result["clauses"].get(c) for c in clauses} == dict.fromkeys(clauses, "passed"), out[-6000:]


def test_on_s3_the_overwrite_clauses_report_the_backends_refusal_not_a_local_only_premise(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Ours refuses to replace a checkpoint on an object store: the suite measures that, it does not assume it."""
    bucket = f"conf-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(bucket)
    result, out = _run_clauses(
        tmp_path, [KILL_SYNC, CONCURRENT], ["--storage-url", f"s3://{bucket}/run"], s3_server.client_env()
    )
    for cid in ("DUR-KILL-1", "DUR-CONC-1"):
        assert result["clauses"].get(cid) == "not measured", out[-6000:]
        reason = result["reasons"][cid]
        assert "local filesystem only" not in reason, reason
        assert "refuses to replace a committed checkpoint" in reason and "CommitError" in reason, reason


def _statuses(result: dict[str, Any], clauses: Sequence[str]) -> dict[str, str | None]:
    return {c: result["clauses"].get(c) for c in clauses}


def test_damage_shows_nothing_on_a_backend_that_loads_nothing(tmp_path: Path) -> None:
    # The old clauses counted every damaged copy's load as "raised" and passed.
    result, out = _run_clauses(tmp_path, [*DAMAGE, PICKLE], ["--backend", NEVER_LOADS])
    assert _statuses(result, DAMAGE_CLAUSES) == dict.fromkeys(DAMAGE_CLAUSES, "not measured"), out[-6000:]
    assert all("an undamaged copy of the checkpoint loads as 'raised'" in result["reasons"][c] for c in DAMAGE_CLAUSES)


def test_a_refused_load_without_target_shows_nothing_on_a_backend_that_loads_nothing(tmp_path: Path) -> None:
    # RESHARD-INTO-1 counted any exception from a load without a live target as the refusal it asks for.
    result, out = _run_clauses(
        tmp_path, ["conformance/test_multirank.py::test_reshard_needs_live_target"], ["--backend", NEVER_LOADS]
    )
    assert _statuses(result, ["RESHARD-INTO-1"]) == {"RESHARD-INTO-1": "not measured"}, out[-6000:]
    assert "needs a resharding load with a live target to work" in result["reasons"]["RESHARD-INTO-1"]


def test_a_refused_foreign_id_shows_nothing_on_a_backend_that_saves_nothing(tmp_path: Path) -> None:
    result, out = _run_clauses(tmp_path, FOREIGN_IDS, ["--backend", NEVER_SAVES])
    clauses = ["SAFE-ID-1", "SAFE-ID-2"]
    assert _statuses(result, clauses) == dict.fromkeys(clauses, "not measured"), out[-6000:]
    assert all("a save to a fresh id raised too" in result["reasons"][c] for c in clauses), result["reasons"]


def test_ours_passes_the_clauses_with_controls(tmp_path: Path) -> None:
    result, out = _run_clauses(tmp_path, [*DAMAGE, PICKLE, *FOREIGN_IDS])
    clauses = [*DAMAGE_CLAUSES, "SAFE-ID-1", "SAFE-ID-2"]
    assert _statuses(result, clauses) == dict.fromkeys(clauses, "passed"), out[-6000:]
