"""Rank programs of the durability profile (run on gloo ranks through simulator.launcher)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from conformance import faults
from conformance.helpers import Where, location, save

RANK_TIMEOUT_S = 15


def _timed_save_error(m: Any, path: Where, value: dict[str, Any]) -> tuple[str | None, float]:
    """(the error the save raised or None, how long it took)."""
    start = time.monotonic()
    error = faults.save_error(m, path, value, timeout=RANK_TIMEOUT_S * 2)
    return error, time.monotonic() - start


def one_rank_raises(root: str) -> dict[str, Any]:
    """Commit OLD on 2 ranks, then save NEW to another id and over OLD where rank 1's item cannot be serialized.

    Returns, per rank, whether each failing save raised and how long the first took, so the test can check
    that the surviving rank raised within the configured wait timeout, and the overwrite probe
    (:func:`faults.overwrite_probe`, two healthy saves): the premise of the part saved over the committed id.
    """
    rank, where = dist.get_rank(), location(root)
    ck = where / "ck"
    m = faults.manager("sync", timeout_s=RANK_TIMEOUT_S)
    try:
        probe = faults.overwrite_probe(m, where / "probe")
        save(m, ck, faults.payload(1))
    finally:
        m.close()
    dist.barrier()
    new = faults.payload(2)
    if rank == 1:  # rank 1's own file (extra_1.pt) cannot be written: a lambda does not pickle
        new["extra"] = {"v": lambda: None}
    m = faults.manager("sync", timeout_s=RANK_TIMEOUT_S)
    try:
        error, elapsed = _timed_save_error(m, where / "fresh", new)
        over_error, _ = _timed_save_error(m, ck, new)  # the id must still hold the previous checkpoint after it
    finally:
        with contextlib.suppress(Exception):  # closing after a failed collective save may repeat the failure
            m.close()
    dist.barrier()
    # Each rank reads its own files: the id must still hold OLD (1), never NEW (2) or a mix.
    after = faults.classify(ck, {"old": 1, "new": 2})
    fresh = faults.classify(where / "fresh", {"new": 2})
    return {
        "rank": rank,
        "error": error,
        "elapsed": elapsed,
        "over_error": over_error,
        "after": after,
        "fresh": fresh,
        "overwrite": probe,
    }


def _stamp(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: the killing process polls for the file and reads it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def save_for_kill(control: str, case: str) -> None:
    """Commit OLD (an earlier id and the id), warm up, then save NEW over the id.

    Checkpoints go under ``case`` (any storage); stamps under the local ``control`` directory: ``ready`` (rank 0,
    wall-clock time before the save over the id), ``replaced-<rank>`` (time it returned) or ``refused-<rank>``
    (the error it raised), then ``done``. The killing process places its instants inside the save over the id
    (measured on an uninterrupted run) and reads from the stamps whether it was still in flight.
    """
    rank, stamps, root = dist.get_rank(), Path(control), location(case)
    m = faults.manager("sync")
    try:
        save(m, root / "earlier", faults.payload(0))
        save(m, root / "ck", faults.payload(1))
        save(m, root / "warm", faults.payload(9, numel=16))
        dist.barrier()
        if rank == 0:
            _stamp(stamps / "ready", repr(time.time()))
        try:
            save(m, root / "ck", faults.payload(2))
        except Exception as exc:  # recorded for the killing process, which reports the clause not measured
            _stamp(stamps / f"refused-{rank}", f"{type(exc).__name__}: {exc}"[:500])
        else:
            _stamp(stamps / f"replaced-{rank}", repr(time.time()))
        dist.barrier()
        if rank == 0:
            _stamp(stamps / "done", repr(time.time()))
    finally:
        m.close()


def classify_cases(paths: list[str]) -> dict[str, dict[str, str]]:
    """Per case: what this rank's load of the id and of the earlier id returned."""
    return {
        p: {
            "id": faults.classify(location(p) / "ck", {"old": 1, "new": 2}),
            "earlier": faults.classify(location(p) / "earlier", {"intact": 0}),
        }
        for p in paths
    }
