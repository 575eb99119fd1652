"""save() called from several threads of one process on one manager: each checkpoint holds its own values.

API_SURFACE §10: successive saves serialize (the next save() blocks until the previous checkpoint is durable).
Before, two threads could both pass the wait for the previous write, and the second staged into the shared slab
while the first's write had not read it yet: every checkpoint committed holding the last thread's values, silently.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager

THREADS = 4
SHAPE = (512, 1024)  # 2 MiB of float32 per save: a staging copy long enough for the threads to overlap


def _config(kind: str) -> CheckpointManager.Config:
    return CheckpointManager.Config.with_async_save() if kind == "async" else CheckpointManager.Config.with_sync_save()


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_saves_from_several_threads_each_commit_their_own_values(tmp_path: Path, kind: str) -> None:
    manager = CheckpointManager(_config(kind))
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def save(i: int) -> None:
        try:
            start.wait(timeout=60)
            for round_ in range(3):
                value = float(10 * i + round_)
                fut: Any = manager.save(str(tmp_path / f"t{i}_r{round_}"), {"model": {"w": torch.full(SHAPE, value)}})
                if fut is not None:
                    fut.result(timeout=120)
        except BaseException as exc:  # reported below, with the thread's index
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(THREADS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        wrong = {}
        for i in range(THREADS):
            for round_ in range(3):
                out = manager.load(str(tmp_path / f"t{i}_r{round_}"), into={"model": {"w": torch.zeros(SHAPE)}})
                got = out["model"]["w"]
                if not torch.equal(got, torch.full(SHAPE, float(10 * i + round_))):
                    wrong[f"t{i}_r{round_}"] = sorted({float(v) for v in got.flatten()[::4096]})
        assert wrong == {}, f"checkpoints committed with another save's values: {wrong}"
    finally:
        manager.close()
