"""Rank functions for tests/test_commit_round18_multirank.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_checkpointing import CheckpointManager


def exit_at_the_commit(final_manifest: str) -> None:
    """subprocess_init_fn of rank 1's writer: once rank 0 has published the checkpoint (its manifest is in
    place), this writer dies without answering the commit step, as a writer the OOM killer takes then would."""
    import torch_checkpointing.checkpoint_writer as writer

    real = writer.agree

    def agree(step: str, transport: Any, compute: Any) -> Any:
        if step.endswith(": the commit"):
            deadline = time.monotonic() + 60
            while not os.path.exists(final_manifest) and time.monotonic() < deadline:
                time.sleep(0.01)
            os._exit(1)
        return real(step, transport, compute)

    writer.agree = agree


def exit_after_publishing() -> None:
    """subprocess_init_fn of rank 0's writer: it publishes the checkpoint, then dies before it answers the commit
    step, so that no other rank hears from it whether it committed."""
    import torch_checkpointing.checkpoint_writer as writer

    real = writer.agree

    def agree(step: str, transport: Any, compute: Any) -> Any:
        if step.endswith(": the commit"):
            compute()
            os._exit(1)
        return real(step, transport, compute)

    writer.agree = agree


def writers_gone_after_the_commit(root: str) -> dict[str, Any]:
    """Two saves: rank 1's writer dies once rank 0 published (`ckpt`), then rank 0's own writer does (`ckpt2`)."""
    rank = dist.get_rank()
    first = Path(root) / "ckpt"
    out = _save_and_load(first, rank, exit_at_the_commit if rank == 1 else None, (str(first / "manifest.json"),))
    # A timeout longer than any load can make the step take: ranks that waited it out are a defect, not a slow
    # machine, and show as an error or as the "not every rank answered" WARNING, never as a number of seconds.
    second = _save_and_load(
        Path(root) / "ckpt2", rank, exit_after_publishing if rank == 0 else None, (), wait_timeout_s=150
    )
    return {"rank": rank, "first": out, "second": second}


def _save_and_load(
    target: Path, rank: int, init_fn: Any, init_args: tuple[Any, ...], wait_timeout_s: float = 10
) -> dict[str, Any]:
    config = CheckpointManager.Config.with_async_save()
    config.save.wait_timeout_secs = wait_timeout_s
    if init_fn is not None:
        config.subprocess_init_fn = init_fn
        config.subprocess_init_args = init_args
    manager = CheckpointManager(config)
    out: dict[str, Any] = {}
    logged: list[str] = []
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)

    def emit(record: logging.LogRecord) -> None:
        (logged if record.levelno >= logging.ERROR else warned).append(record.getMessage())

    handler.emit = emit  # type: ignore[method-assign]
    logging.getLogger("torch_checkpointing").addHandler(handler)
    out["logged"], out["warned"] = logged, warned
    try:
        wait_for_the_writer(manager)
        started = time.monotonic()  # the writer's own start (seconds on a busy machine) is not the save's time
        write = manager.save(str(target), {"model": {"w": torch.full((4,), float(rank + 1))}})
        try:
            write.result(120)
            out["error"] = None
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["s"] = time.monotonic() - started
        dist.barrier()
        out["manifest_there"] = (target / "manifest.json").exists()
        into = {"model": {"w": torch.zeros(4)}}
        try:
            manager.load(str(target), into=into)
            out["loaded"] = into["model"]["w"].tolist()
        except Exception as exc:
            out["loaded"] = f"{type(exc).__name__}: {exc}"
    finally:
        manager.close()
        logging.getLogger("torch_checkpointing").removeHandler(handler)
    return out


def wait_for_the_writer(manager: CheckpointManager, timeout_s: float = 120.0) -> None:
    """Until the manager's async writer process is up (a new manager's, or a killed one's replacement)."""
    deadline = time.monotonic() + timeout_s
    while manager.writer_pid is None:
        assert time.monotonic() < deadline, f"the writer process did not start within {timeout_s}s"
        time.sleep(0.02)
