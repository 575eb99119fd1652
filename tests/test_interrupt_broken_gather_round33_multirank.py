"""A Ctrl-C on rank 0 while its exchange with rank 1 breaks (rank 1 SIGKILLed: two real gloo ranks, a real
SIGINT; round 33).

The interrupt wins: rank 0 raises KeyboardInterrupt, as the user asked, not the CommitError the broken exchange
would give. Before, that was all it said: that the other ranks were lost at that moment too went unsaid on
rank 0, so a user who pressed Ctrl-C as a peer died learned of the death nowhere. Now the broken exchange is
logged at WARNING, naming the step and what gloo said, and the KeyboardInterrupt is raised as itself.

Two points: the SIGINT held inside the gather (it runs once the gather has returned, broken), and the SIGINT
during the roll call that follows a broken gather (rank 0 waiting for the survivors to report in).

The ranks are spawned here (not by `simulator.launcher.launch`, which stops every rank once one dies).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.probes import children_import_from, published_store

pytestmark = pytest.mark.multirank

WORLD = 2
TIMEOUT_S = 6  # save.wait_timeout_secs: the gloo group's timeout too
HANG_S = 120  # only to stop a hang
REPO = Path(__file__).resolve().parent.parent
_STORE_WAIT = timedelta(seconds=60)


def _arm(point: str) -> None:
    """Rank 0's SIGINT: as its first gather of the save begins (held there until the gather returns, broken),
    or as the roll call after the broken gather begins its wait for the survivors (its handler runs there)."""
    from torch.distributed import distributed_c10d

    from tests.sigint_at import sigint_at
    from torch_checkpointing.store_channel import StoreChannel

    if point == "gather":
        sigint_at(distributed_c10d, "all_gather", 3.0)  # by then rank 1 is gone: the real gather breaks
    else:
        sigint_at(StoreChannel, "wait_for", 0.0, when=lambda _, name, *a, **k: name.startswith("rollcall/"))


def _rank(rank: int, root: str, out_dir: str, point: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import logging

    from tests.async_multirank_support import WarningLines, local_sync_manager, said
    from torch_checkpointing import checkpoint_manager as cm

    store = published_store(rank, WORLD, out_dir, _STORE_WAIT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=_STORE_WAIT)
    manager = local_sync_manager(TIMEOUT_S)
    state = {"model": {"w": torch.full((8,), float(rank))}}
    manager.save(f"{root}/ck1", state)
    warnings = WarningLines()
    logging.getLogger("torch_checkpointing").addHandler(warnings)
    dist.barrier()
    if rank == 1:  # dies as its save's first agreed step begins, before it joins that step's gather
        cm.agree = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
    else:
        _arm(point)
    out = {"save": said(lambda: manager.save(f"{root}/ck2", state)), "warnings": warnings.lines}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    os._exit(0)  # the default group lost rank 1: no clean teardown to wait for


def _launch(root: Path, point: str) -> dict[str, Any]:
    """What rank 0 gave (rank 1 is killed)."""
    out_dir = root / "out"
    out_dir.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(root), str(out_dir), point)) for r in range(WORLD)]
    with children_import_from(REPO):
        for p in procs:
            p.start()
    deadline = time.monotonic() + HANG_S
    try:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    found = out_dir / "rank0.json"
    assert found.exists(), "rank 0 gave no outcome"
    return dict(json.loads(found.read_text()))


@pytest.mark.parametrize("point", ["gather", "roll call"])
def test_the_interrupt_is_raised_and_the_broken_exchange_said(tmp_path: Path, point: str) -> None:
    """Defect: rank 0 raised its KeyboardInterrupt and logged nothing of the exchange that broke under it."""
    got = _launch(tmp_path, point)
    assert got["save"].startswith("KeyboardInterrupt"), got
    broken = [line for line in got["warnings"] if "lost contact with the other ranks" in line]
    assert len(broken) == 1, got["warnings"]
    assert "Checkpoint save" in broken[0] and "interrupt" in broken[0], broken
