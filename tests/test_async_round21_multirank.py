"""Rank 1's writer process dies, or cannot read its request, in a save on two real gloo ranks (one launch).

* Before it takes the request (SIGSTOPped, the request waiting unread in its pipe, then SIGKILLed): the request
  goes to a new writer on rank 1, and the save commits on every rank, whole, rank 1's files included.
* Unable to unpickle the request (a callback whose load raises): every rank fails at once, naming rank 1 and why.
* After it answered the commit's first agreement (its files written), while rank 0 writes the manifest: rank 0
  commits the checkpoint, so every rank must say so. Before, rank 1 raised "died during the write ... the id holds
  its previous checkpoint, or this one", and rank 0's writer waited the save's whole timeout twice for rank 1's
  dead writer (its answer to the commit, then its acknowledgement) before it called the save done.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests import async_multirank_support as shared
from tests.memory_storage import Control
from tests.probes import stop
from tests.test_async_round21 import LoadsBadly
from torch_checkpointing import CheckpointManager

pytestmark = pytest.mark.multirank
WORLD = 2
WAIT_S = 30


def _outcome(future: Any) -> str:
    return shared.outcome(future, WAIT_S * 4)


def _wait_locked(manager: CheckpointManager) -> None:
    """Until rank 1's save holds its writer (its request is sent, or about to be)."""
    deadline = time.monotonic() + WAIT_S
    while not manager._saver.process._lock.locked():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "no write took the writer"
        time.sleep(0.005)


def _killed_before_taking(manager: CheckpointManager, root: str, rank: int, out: dict[str, Any]) -> None:
    pid = manager.writer_pid
    assert pid is not None
    if rank == 1:
        stop(pid)  # alive, but reads nothing: the request waits in its pipe
    dist.barrier()
    started = time.monotonic()
    future = manager.save(f"{root}/retried", shared.state(2, rank))
    if rank == 1:
        _wait_locked(manager)
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
    out["retried"] = _outcome(future)
    out["retried_s"] = time.monotonic() - started
    out["retried_new_writer"] = manager.writer_pid not in (None, pid)
    out["retried_pid"] = pid
    dist.barrier()
    out["retried_files"] = sorted(p.name for p in Path(root, "retried").glob("*.pt"))
    out["retried_loaded"] = shared.loaded(manager, f"{root}/retried")


def _killed_in_the_commit(
    manager: CheckpointManager, root: str, rank: int, controls: list[Control], out: dict[str, Any]
) -> None:
    if rank == 0:
        controls[0].block("manifest")  # rank 0's writer stops in the commit, after every rank's files are in
    dist.barrier()
    pid = manager.writer_pid
    started = time.monotonic()
    future = manager.save(f"{root}/commit", shared.state(3, rank))
    if rank == 1:
        controls[0].wait_blocked(WAIT_S * 2)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)  # rank 1's trainer sees its writer gone before rank 0 commits
        controls[0].reset()
    out["commit"] = _outcome(future)
    out["commit_s"] = time.monotonic() - started
    dist.barrier()
    out["commit_files"] = sorted(p.name for p in Path(root, "commit").glob("*.pt"))
    out["commit_loaded"] = shared.loaded(manager, f"{root}/commit")


def _unloadable_on_rank_1(manager: CheckpointManager, root: str, rank: int, out: dict[str, Any]) -> None:
    if rank == 1:
        manager.config.finalize_callback = LoadsBadly()
    dist.barrier()
    started = time.monotonic()
    out["unloadable"] = _outcome(manager.save(f"{root}/unloadable", shared.state(5, rank)))
    out["unloadable_s"] = time.monotonic() - started
    manager.config.finalize_callback = None
    dist.barrier()
    out["unloadable_exists"] = Path(root, "unloadable").exists()


def writer_dies_on_rank_1(root: str, control_root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    controls = [Control(f"{control_root}/{r}") for r in range(WORLD)]
    manager, warnings = shared.async_manager(str(controls[rank].root), WAIT_S)
    out: dict[str, Any] = {"rank": rank}
    out["first"] = _outcome(manager.save(f"{root}/first", shared.state(1, rank)))
    _killed_before_taking(manager, root, rank, out)
    _killed_in_the_commit(manager, root, rank, controls, out)
    _unloadable_on_rank_1(manager, root, rank, out)
    return shared.after_and_close(manager, warnings, root, rank, out, WAIT_S * 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return shared.launch_job(writer_dies_on_rank_1, WORLD, tmp_path_factory.mktemp("round21"), timeout=600)


def test_a_request_rank_1s_writer_never_took_goes_to_a_new_writer_and_commits_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        assert r["first"] == "ok", r
        assert r["retried"] == "ok", r
        assert r["retried_files"] == ["model_0.pt", "model_1.pt"], r
        assert r["retried_loaded"] == 20.0 + r["rank"], r
    rank_1 = results[1]
    assert rank_1["retried_new_writer"], rank_1
    said = [w for w in rank_1["warnings"] if str(rank_1["retried_pid"]) in w and "before it took" in w]
    assert said and "SIGKILL" in said[0], rank_1["warnings"]


def test_rank_1s_writer_killed_after_its_files_are_in_agrees_with_rank_0s_commit(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert [x["commit"] for x in results] == ["ok", "ok"], results
        assert r["commit_s"] < WAIT_S / 2, results
        assert r["commit_files"] == ["model_0.pt", "model_1.pt"], r
        assert r["commit_loaded"] == 30.0 + r["rank"], r
        assert r["after"] == "ok" and r["after_loaded"] == 40.0 + r["rank"], r


def test_a_request_rank_1s_writer_cannot_unpickle_fails_every_rank_at_once(results: list[dict[str, Any]]) -> None:
    """Before, rank 1's writer died unpickling it, and so did a second writer it was retried on: every rank
    failed with "died (exit code 1) before it took the write", naming neither the unpickling nor the fix. The
    writer now answers with the failure without having reached the commit's agreement, so rank 1's trainer
    answers it (else rank 0's writer would wait the save's whole timeout for rank 1)."""
    for r in results:
        assert r["unloadable"].startswith("CommitError:"), r["unloadable"]
        assert "rank 1" in r["unloadable"] and "could not be unpickled in the writer process" in r["unloadable"], r
        assert r["unloadable_s"] < WAIT_S / 2, r
        assert not r["unloadable_exists"], r
