"""Lifecycle misuse on real gloo ranks: a save inside `with manager.lock():` on one rank (rank 1, not rank 0) is
refused on every rank at once, nothing is committed, and the next save of every rank works; a collective load of
an id whose first async save is still in flight says so on every rank."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank
WORLD = 2
WAIT_S = 60


def save_inside_lock_on_rank_1(root: str) -> dict[str, Any]:
    """Rank 1 saves inside lock(), rank 0 outside it; then both save normally and load what they saved."""
    rank = dist.get_rank()
    config = CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    config.save.wait_timeout_secs = WAIT_S
    manager = CheckpointManager(config)
    out: dict[str, Any] = {"rank": rank}
    state = {"model": {"w": torch.full((4,), float(rank + 1))}}
    started = time.monotonic()
    try:
        if rank == 1:
            with manager.lock():
                manager.save(f"{root}/refused", state)
        else:
            manager.save(f"{root}/refused", state)
        out["refused"] = "no error"
    except CheckpointError as exc:
        out["refused"] = f"{type(exc).__name__}: {exc}"
    out["refused_s"] = time.monotonic() - started
    out["refused_exists"] = Path(root, "refused").exists()
    manager.save(f"{root}/after", state).result(WAIT_S)
    into = {"model": {"w": torch.zeros(4)}}
    manager.load(f"{root}/after", into)
    out["after_loaded"] = float(into["model"]["w"][0])
    manager.close()
    return out


def test_save_inside_lock_on_rank_1_is_refused_on_every_rank_at_once(
    both_cases: list[dict[str, dict[str, Any]]],
) -> None:
    results = [per_rank["inside_lock"] for per_rank in both_cases]
    for r in results:
        assert "inside `with manager.lock():`" in r["refused"], r
        assert "rank 1" in r["refused"] or r["rank"] == 1, r
        assert r["refused_s"] < WAIT_S / 3, r
        assert not r["refused_exists"], r
        assert r["after_loaded"] == float(r["rank"] + 1), r


def load_while_the_save_is_in_flight(root: str, control_dir: str) -> dict[str, Any]:
    """Every rank saves an id with slowed writes, then loads it at once (collectively)."""
    rank = dist.get_rank()
    control = Control(f"{control_dir}/{rank}")
    config = CheckpointManager.Config(storage_config=RecordingStorageConfig(control_dir=str(control.root)))
    config.save.wait_timeout_secs = WAIT_S
    manager = CheckpointManager(config)
    manager.save(f"{root}/warm", {"model": {"w": torch.zeros(4)}}).result(WAIT_S)
    control.block("model")  # the write is held until half a second into the load (a delay of it raced save())
    future = manager.save(f"{root}/in_flight", {"model": {"w": torch.full((4,), float(rank + 1))}})
    out: dict[str, Any] = {"rank": rank, "done_before_load": future.done()}
    threading.Timer(0.5, lambda: (control.root / "block_on").unlink(missing_ok=True)).start()
    into = {"model": {"w": torch.zeros(4)}}
    try:
        manager.load(f"{root}/in_flight", into)
        out["loaded"] = float(into["model"]["w"][0])
    except (CheckpointError, FileNotFoundError) as exc:
        out["loaded"] = f"{type(exc).__name__}: {exc}"
    out["done_after_load"] = future.done()
    future.result(WAIT_S)
    control.reset()
    manager.close()
    return out


def test_a_collective_load_of_an_id_whose_first_save_is_in_flight_waits_for_it_on_every_rank(
    both_cases: list[dict[str, dict[str, Any]]],
) -> None:
    results = [per_rank["in_flight"] for per_rank in both_cases]
    for r in results:
        assert not r["done_before_load"], r
        assert r["loaded"] == float(r["rank"] + 1), r
        assert r["done_after_load"], r


def both_cases_one_after_another(root: str) -> dict[str, dict[str, Any]]:
    """Both cases in one launch (ranks are seconds each to start), each in a directory of its own."""
    return {
        "inside_lock": save_inside_lock_on_rank_1(f"{root}/inside_lock"),
        "in_flight": load_while_the_save_is_in_flight(f"{root}/ckpt", f"{root}/control"),
    }


@pytest.fixture(scope="module")
def both_cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("lifecycle_attacks")
    (root / "inside_lock").mkdir()
    return launch(both_cases_one_after_another, WORLD, args=(str(root),), timeout=480)
