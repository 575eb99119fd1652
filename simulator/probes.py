"""Tiny rank functions that exercise the launcher itself (importable by spawned ranks)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from simulator.launcher import report_progress


def rank_and_sum() -> tuple[int, int, float]:
    """Prove the process group works: every rank contributes its rank to an all-reduce."""
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    report_progress(f"rank {dist.get_rank()} reduced")
    return dist.get_rank(), dist.get_world_size(), float(t.item())


def env_value(key: str) -> str | None:
    """Let a caller check what environment a rank saw."""
    return os.environ.get(key)


def crash_on(rank: int, message: str) -> int:
    """Raise on one rank after logging a line, so failure reports can be checked."""
    if dist.get_rank() == rank:
        print(f"about to fail on rank {rank}", flush=True)
        raise RuntimeError(message)
    time.sleep(30)
    return dist.get_rank()


def exit_on(rank: int, code: int) -> int:
    """Hard-exit one rank (no Python exception), like a segfault or os._exit would."""
    if dist.get_rank() == rank:
        print(f"exiting hard on rank {rank}", file=sys.stderr, flush=True)
        os._exit(code)
    time.sleep(30)
    return dist.get_rank()


def hang_on(rank: int) -> int:
    """Block one rank forever so the launcher's timeout is exercised."""
    print(f"rank {dist.get_rank()} entering", flush=True)
    if dist.get_rank() == rank:
        print(f"rank {rank} hanging now", flush=True)
        time.sleep(3600)
    return dist.get_rank()


def fail_while_others_wait(rank: int, message: str) -> int:
    """One rank raises while the others sit in a collective: they then fail too, with a gloo error."""
    if dist.get_rank() == rank:
        raise ValueError(message)
    dist.barrier()
    return dist.get_rank()


def break_links_then_fail(rank: int, message: str, delay_s: float) -> int:
    """The worst case for blame: the failing rank drops its connections first and raises only later.

    The waiting ranks fail (connection closed) before the culprit has raised anything, so a launcher that
    reports whichever process exited first blames an innocent rank every time.
    """
    if dist.get_rank() == rank:
        dist.destroy_process_group()
        time.sleep(delay_s)
        raise ValueError(message)
    dist.barrier()
    return dist.get_rank()
