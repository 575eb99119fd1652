"""A multi-rank manager dropped without close(): what it holds is given back on every rank, and it says so.

Two real gloo ranks on 127.0.0.1. Each rank builds managers and drops them without close() (as a script that
builds one per evaluation does), collects them, and then checks what is left: the manager's own gloo group
(its sockets to the other rank and their threads), rank 0's TCPStore (its listening port) and the writer
process. Before the fix every dropped manager kept its gloo group registered with torch.distributed until
exit (a loop leaked sockets and threads per manager), and nothing said that close() had not been called.
A manager dropped while its async save is in flight still commits that save: the store its writer commits
through stays up until the save is done.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank
WORLD = 2
WAIT_S = 60
DROPPED = 4


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _config(sync: bool) -> CheckpointManager.Config:
    config = CheckpointManager.Config.with_sync_save() if sync else CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = WAIT_S
    return config


def _settle() -> None:
    """Collect, then wait (bounded) for the threads that close dropped managers."""
    deadline = time.monotonic() + WAIT_S
    gc.collect()
    while time.monotonic() < deadline and any(t.name == "ckpt-dropped-close" for t in threading.enumerate()):
        time.sleep(0.05)
    gc.collect()


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def drop_managers_without_close(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    records = _Records()
    logging.getLogger("torch_checkpointing").addHandler(records)
    out: dict[str, Any] = {"rank": rank}
    first = CheckpointManager(_config(sync=True))  # the first one's one-time costs are not counted
    first.save(f"{root}/warm", {"w": torch.ones(2)})
    first.close()
    _settle()
    groups, fds, threads = _groups(), _fds(), threading.active_count()
    for i in range(DROPPED):
        manager = CheckpointManager(_config(sync=True))
        manager.save(f"{root}/sync_{i}", {"w": torch.full((2,), float(i))})
        del manager
        _settle()
        dist.barrier()  # both ranks dropped theirs before the next one is built
    out["groups_left"] = _groups() - groups
    out["fds_left"] = _fds() - fds
    out["threads_left"] = threading.active_count() - threads
    out["warnings"] = [m for m in records.messages if "close()" in m]
    # A manager dropped with its async save in flight: the save still commits on both ranks.
    manager = CheckpointManager(_config(sync=False))
    manager.save(f"{root}/warm_async", {"w": torch.ones(2)}).result(WAIT_S)
    future = manager.save(f"{root}/in_flight", {"w": torch.full((1 << 16,), 7.0)})
    writer = manager.writer_pid
    del manager
    result: Any = "unresolved"
    try:
        result = future.result(WAIT_S)
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"[:500]
    out["in_flight"] = result
    _settle()
    dist.barrier()
    out["writer_alive"] = writer is not None and _alive(writer)
    # The next manager, built with the same default group, works.
    with CheckpointManager(_config(sync=True)) as again:
        again.save(f"{root}/after", {"w": torch.full((2,), 5.0)})
        out["after"] = float(again.load(f"{root}/after", {"w": torch.zeros(2)})["w"][0])
        try:
            out["in_flight_loaded"] = float(again.load(f"{root}/in_flight", {"w": torch.zeros(1 << 16)})["w"][0])
        except Exception as exc:
            out["in_flight_loaded"] = f"{type(exc).__name__}: {exc}"[:300]
    logging.getLogger("torch_checkpointing").removeHandler(records)
    return out


def _alive(pid: int) -> bool:
    deadline = time.monotonic() + WAIT_S  # its exit saves coverage data in CI: seconds on a busy machine
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


def test_managers_dropped_without_close_give_back_their_group_and_store_on_every_rank(
    both_cases: list[dict[str, dict[str, Any]]],
) -> None:
    results = [per_rank["dropped"] for per_rank in both_cases]
    for r in results:
        assert r["groups_left"] == 0, r  # before: one gloo group per dropped manager, kept until exit
        assert r["fds_left"] <= 2, r  # its sockets with it
        assert r["threads_left"] <= 1, r
        assert r["in_flight"] is None, r  # committed although its manager was dropped
        assert r["in_flight_loaded"] == 7.0 and r["after"] == 5.0, r
        assert not r["writer_alive"], r
        said = [m for m in r["warnings"] if "without close()" in m]
        assert len(said) >= DROPPED, r
        assert all("Call close()" in m and "with CheckpointManager(config) as manager" in m for m in said), r


def config_changed_on_rank_1(root: str) -> dict[str, Any]:
    """Rank 1 changes a construction-only field after construction; both ranks save, then set it back."""
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank}
    with CheckpointManager(_config(sync=True)) as manager:
        if rank == 1:
            manager.config.save.wait_timeout_secs = -1
        started = time.monotonic()
        try:
            manager.save(f"{root}/refused", {"w": torch.ones(2)})
            out["refused"] = "no error"
        except Exception as exc:
            out["refused"] = f"{type(exc).__name__}: {exc}"
        out["refused_s"] = time.monotonic() - started
        out["refused_exists"] = Path(root, "refused").exists()
        manager.config.save.wait_timeout_secs = WAIT_S
        manager.save(f"{root}/after", {"w": torch.full((2,), 3.0)})
        out["after"] = float(manager.load(f"{root}/after", {"w": torch.zeros(2)})["w"][0])
    return out


def test_a_config_changed_on_rank_1_is_refused_on_every_rank_at_once(
    both_cases: list[dict[str, dict[str, Any]]],
) -> None:
    results = [per_rank["config_changed"] for per_rank in both_cases]
    for r in results:
        assert "Config.save.wait_timeout_secs was changed after this manager was built" in r["refused"], r
        assert r["rank"] == 1 or "rank 1" in r["refused"], r
        assert r["refused_s"] < WAIT_S / 3, r
        assert not r["refused_exists"] and r["after"] == 3.0, r


def both_cases_one_after_another(root: str) -> dict[str, dict[str, Any]]:
    """Both cases in one launch (ranks are seconds each to start), each in a directory of its own. The dropped
    managers first: it counts what the process holds, in a process that has run nothing else yet."""
    return {
        "dropped": drop_managers_without_close(f"{root}/dropped"),
        "config_changed": config_changed_on_rank_1(f"{root}/config_changed"),
    }


@pytest.fixture(scope="module")
def both_cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("round9")
    for name in ("dropped", "config_changed"):
        (root / name).mkdir()
    return launch(both_cases_one_after_another, WORLD, args=(str(root),), timeout=600)
