"""Round 9: an operator's `prune` and `gc` run again and again, in another process, while a 2-rank job saves
(sync and async; per-rank `{rank}` files, its own retention on rank 0) into the same root.

What must hold: every save commits; no command deletes or damages a committed checkpoint the policy keeps, or
anything outside the root (a link to a directory outside, planted inside a leftover, under the root and
inside a checkpoint); `prune` and `gc` never fail; what is left is intact and verifies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torch_checkpointing import CheckpointManager, ItemSpec, RetentionPolicy, list_checkpoints
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
from torch_checkpointing.discovery import damage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
KEEP = 2

OPERATOR = """
import json, sys, time
from pathlib import Path
from torch_checkpointing.cli import main
root, stop = sys.argv[1], Path(sys.argv[2])
codes = []
Path(sys.argv[3]).touch()  # imported and ready
while not stop.exists():
    codes.append(["prune", main(["prune", root, "--keep-last", "%d"])])
    codes.append(["gc", main(["gc", root, "--older-than", "0"])])
    time.sleep(0.01)
print(json.dumps(codes), flush=True)
"""


def save_while_operated(root: str, stop: str, ready: str, mode: str) -> dict[str, Any]:
    """Rank function: STEPS saves (async: not waiting on one before the next) with per-rank files and
    retention, started once the operator's loop runs."""
    rank = dist.get_rank()
    deadline = time.monotonic() + 120
    while not Path(ready).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    cfg = CheckpointManager.Config.with_async_save() if mode == "async" else CheckpointManager.Config.with_sync_save()
    cfg.items = {"misc": ItemSpec(requires_copy=False, layout=LayoutInfo("rank_{rank}/misc.json", JsonSerialization()))}
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    cfg.retention = RetentionPolicy(keep_last=KEEP, unowned_after_s=0.0)
    futures = []
    with CheckpointManager(cfg) as manager:
        for step in range(1, STEPS + 1):
            state = {"model": {"w": torch.full((256,), float(step * 10 + rank))}, "misc": {"rank": rank, "step": step}}
            futures.append(manager.save(f"{root}/step_{step}", state, metrics={"loss": 1.0 / step}))
        for fut in futures:
            if fut is not None:
                fut.result(timeout=120)
    if rank == 0:
        Path(stop).touch()
    return {"rank": rank, "saved": len(futures)}


def _plant(root: Path, outside: Path) -> list[Path]:
    """Links out of the root in every place a command looks: the returned links must all survive but one."""
    root.mkdir(parents=True)
    os.symlink(outside, root / "latest")  # under the root: never listed, never collected
    dead_tmp = root / ".step_0.tmp-0badc0de-1"  # a dead save's temporary (no owner lock on this host)
    dead_tmp.mkdir()
    (dead_tmp / ".incomplete").write_text("")
    os.symlink(outside, dead_tmp / "escape")  # gc removes the temporary: the link, never what it points at
    return [root / "latest"]


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_prune_and_gc_in_a_loop_during_a_two_rank_job(tmp_path: Path, mode: str) -> None:
    from simulator.launcher import launch

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_text("alive")
    root = tmp_path / "run"
    kept_links = _plant(root, outside)
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    operator = subprocess.Popen(
        [sys.executable, "-c", OPERATOR % KEEP, str(root), str(stop), str(ready)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        results = launch(save_while_operated, 2, args=(str(root), str(stop), str(ready), mode), timeout=300)
        stop.touch()  # also when the job failed before rank 0 got to it
        out, err = operator.communicate(timeout=120)
    finally:
        stop.touch()
        if operator.poll() is None:
            operator.kill()
            operator.wait(timeout=30)
    assert [r["saved"] for r in results] == [STEPS, STEPS]
    assert ready.exists() and operator.returncode == 0, err[-3000:]
    codes = json.loads(out.strip().splitlines()[-1])
    assert len(codes) >= 2 and all(code == 0 for _, code in codes), (codes, err[-3000:])
    assert "Traceback" not in err, err[-3000:]

    assert (outside / "canary").read_text() == "alive"
    assert all(link.is_symlink() for link in kept_links)
    found = list_checkpoints(root)
    assert [c.name for c in found] == [f"step_{s}" for s in range(STEPS - KEEP + 1, STEPS + 1)]
    for c in found:
        assert damage(c.path) is None, c.path
        proc = subprocess.run(
            [sys.executable, "-m", "torch_checkpointing", "verify", c.path], cwd=REPO, capture_output=True, timeout=300
        )
        assert proc.returncode == 0, proc.stdout
        misc = [json.loads((Path(c.path) / f"rank_{r}" / "misc.json").read_text()) for r in (0, 1)]
        assert [m["rank"] for m in misc] == [0, 1] and {m["step"] for m in misc} == {c.step}
    assert sorted(os.listdir(root)) == ["latest", *(c.name for c in found)], "no leftover once the job is closed"
