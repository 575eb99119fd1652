"""A multi-rank manager whose `save.wait_timeout_secs` is longer than torch's store and gloo group can wait
(`math.inf` for "never", or 1e12 s) saves and loads (two real gloo ranks, one launch).

The config takes any non-negative number of seconds, and one rank takes `math.inf` as no limit. On several
ranks the manager handed the number to torch as it was: `inf` and `1e300` raised a bare OverflowError from
`CheckpointManager(...)` ("cannot convert float infinity to integer", "Python int too large to convert to C
int"), and `1e12` was taken, then every save failed at once with "lost contact with rank 0, which hosts the
checkpoint store", rank 0 being alive. Now a timeout past the longest wait the store's and the group's clocks
hold (`MAX_OS_WAIT_S`, about 23 days) waits that long on them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch

pytestmark = pytest.mark.multirank


def _save_and_load(root: str, timeout_s: float, saver: str) -> str:
    from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager, SyncCheckpointSaverConfig

    rank = dist.get_rank()
    kind = AsyncCheckpointSaverConfig if saver == "async" else SyncCheckpointSaverConfig
    try:
        config = CheckpointManager.Config(save=kind(wait_timeout_secs=timeout_s))
        with CheckpointManager(config) as manager:
            write = manager.save(f"{root}/ck", {"model": {"w": torch.full((4,), float(rank))}})
            if write is not None:
                write.result(120)
            loaded: Any = manager.load(f"{root}/ck", {"model": None})
            return "ok" if torch.equal(loaded["model"]["w"], torch.full((4,), float(rank))) else "wrong data"
    except Exception as exc:  # what each rank met, for the assertion to show
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize(
    ("timeout_s", "saver"),
    [(math.inf, "sync"), (1e300, "sync"), (1e12, "sync"), (math.inf, "async")],
    ids=["inf", "1e300", "1e12", "inf-async"],
)
def test_a_timeout_past_what_torch_waits_still_saves_on_several_ranks(
    tmp_path: Path, timeout_s: float, saver: str
) -> None:
    assert launch(_save_and_load, 2, args=(str(tmp_path), timeout_s, saver), timeout=240) == ["ok", "ok"]
