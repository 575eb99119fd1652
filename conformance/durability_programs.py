"""Rank programs of the durability profile (run on gloo ranks through simulator.launcher)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from conformance import faults
from conformance.helpers import location, save

RANK_TIMEOUT_S = 15


def one_rank_raises(root: str) -> dict[str, Any]:
    """Commit OLD on 2 ranks, then save NEW to another id where rank 1's item cannot be serialized.

    Returns, per rank, whether the failing save raised and how long it took, so the test can
    check that the surviving rank raised within the configured wait timeout.
    """
    rank = dist.get_rank()
    ck = location(root) / "ck"
    m = faults.manager("sync", timeout_s=RANK_TIMEOUT_S)
    try:
        save(m, ck, faults.payload(1))
    finally:
        m.close()
    dist.barrier()
    new = faults.payload(2)
    if rank == 1:  # rank 1's own file (extra_1.pt) cannot be written: a lambda does not pickle
        new["extra"] = {"v": lambda: None}
    m = faults.manager("sync", timeout_s=RANK_TIMEOUT_S)
    start = time.monotonic()
    error = None
    try:  # to a fresh id: a backend that refuses to replace a checkpoint is still tested
        save(m, location(root) / "fresh", new, timeout=RANK_TIMEOUT_S * 2)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    elapsed = time.monotonic() - start
    # The same failing save over the committed id (a backend may refuse to replace a checkpoint at all): it must
    # leave the id holding the previous checkpoint.
    with contextlib.suppress(Exception):
        save(m, ck, new, timeout=RANK_TIMEOUT_S * 2)
    with contextlib.suppress(Exception):
        m.close()
    dist.barrier()
    # Each rank reads its own files: the id must still hold OLD (1), never NEW (2) or a mix.
    after = faults.classify(ck, {"old": 1, "new": 2})
    fresh = faults.classify(location(root) / "fresh", {"new": 2})
    return {"rank": rank, "error": error, "elapsed": elapsed, "after": after, "fresh": fresh}


def _stamp(path: Path) -> None:
    """Write the wall-clock time to ``path`` atomically: the killing process polls for the file and reads it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(repr(time.time()))
    tmp.replace(path)


def save_for_kill(case: str) -> None:
    """Commit OLD (an earlier id and the id), warm up, then save NEW over the id; files mark ready and done.

    ``ready`` and ``done`` hold wall-clock times, so the killing process can place its instants
    inside the NEW save (measured on an uninterrupted run).
    """
    rank, root = dist.get_rank(), Path(case)
    m = faults.manager("sync")
    try:
        save(m, root / "earlier", faults.payload(0))
        save(m, root / "ck", faults.payload(1))
        save(m, root / "warm", faults.payload(9, numel=16))
        dist.barrier()
        if rank == 0:
            _stamp(root / "ready")
        with contextlib.suppress(Exception):  # a backend may refuse to replace a checkpoint
            save(m, root / "ck", faults.payload(2))
        save(m, root / "fresh", faults.payload(2))
        dist.barrier()
        if rank == 0:
            _stamp(root / "done")
    finally:
        m.close()


def classify_cases(paths: list[str]) -> dict[str, dict[str, str]]:
    """Per case: what this rank's load of the id and of the earlier id returned."""
    return {
        p: {
            "id": faults.classify(Path(p) / "ck", {"old": 1, "new": 2}),
            "fresh": faults.classify(Path(p) / "fresh", {"new": 2}),
            "earlier": faults.classify(Path(p) / "earlier", {"intact": 0}),
        }
        for p in paths
    }
