"""One client of rank 0's checkpoint store per process, kept across saves (two real gloo ranks, one launch;
round 24).

A TCPStore client's connect stalls exactly 5 s now and then (about 7 connects in 200 on a test machine), and
every multi-rank save opened a new client in each rank's writer process (in the trainer, for sync saves): about
one save in 25 took 5 s more to be durable. Each process now keeps its client of the store host across saves.
Counted at the host's port from outside the engine (`connections_to`: /proc/net/tcp lists every connection
open, or closed less than a minute ago): before, each of the saves below added one connection per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from simulator.launcher import launch
from tests.async_multirank_support import loaded, local_async_manager, outcome, state
from tests.multirank_jobs import _config
from tests.probes import connections_to, open_clients_of
from torch_checkpointing import CheckpointManager

pytestmark = pytest.mark.multirank
WORLD = 2
SAVES = 6
TIMEOUT_S = 60


def _saves(manager: CheckpointManager, root: Path) -> dict[str, Any]:
    """A first save (each process connects), then `SAVES` more, counting the connections to the store host
    made meanwhile; after the last of them on every rank."""
    rank = dist.get_rank()
    first = _save(manager, root / "0", state(0, rank))
    dist.barrier()
    port = manager._ctx.store_address.port  # type: ignore[union-attr]
    before = connections_to(port)
    results = [_save(manager, root / f"{i}", state(i, rank)) for i in range(1, SAVES + 1)]
    dist.barrier()
    after = connections_to(port)
    out = {"results": [first, *results], "new": sorted(after - before), "clients": len(open_clients_of(port))}
    out["loaded"] = loaded(manager, str(root / f"{SAVES}"))
    manager.close()
    return out


def _save(manager: CheckpointManager, path: Path, value: dict[str, Any]) -> str:
    """The save, waited for: "ok" or its failure as `Type: message` (a sync save returns no Future)."""
    try:
        future = manager.save(str(path), value)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok" if future is None else outcome(future, TIMEOUT_S)


def _job(root: str) -> dict[str, Any]:
    config = _config(False)
    config.save.wait_timeout_secs = TIMEOUT_S
    sync = CheckpointManager(config)
    return {
        "async": _saves(local_async_manager(TIMEOUT_S), Path(root) / "async"),
        "sync": _saves(sync, Path(root) / "sync"),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_job, WORLD, args=(str(tmp_path_factory.mktemp("clients")),), timeout=300)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_saves_after_the_first_connect_no_new_client_to_the_store(ranks: list[dict[str, Any]], mode: str) -> None:
    for rank, out in enumerate(ranks):
        got = out[mode]
        assert got["results"] == ["ok"] * (SAVES + 1), got
        assert got["loaded"] == SAVES * 10.0 + rank, got
        # Before: 2 new connections per save (one per rank's writer), 12 here.
        assert got["new"] == [], f"{len(got['new'])} connections to the store in {SAVES} saves: {got}"
        # The clients kept open: the host's own, and one per rank. Counted open, not connected: a TCPStore client
        # retries its whole connect (a new connection) when its first exchange fails on a busy machine, and the
        # connections a single connect makes are counted in test_store_clients_round24.py.
        assert got["clients"] <= 1 + WORLD, got
