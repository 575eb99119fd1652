"""What the tests of the soft limit of open files (RLIMIT_NOFILE) share: the skip where it cannot be raised, and a
child that starts under a soft limit of 256 (`UNDER_256`: the start of its code, run by `run_under_256`).

A load raises the soft limit to what its files need and puts it back once no load is in flight; each test sees
that from a child of its own, whose limit it sets without touching the test process's.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest

from tests.probes import fresh_process

__all__ = ["OUT_OF_DESCRIPTORS", "UNDER_256", "run_under_256", "skip_without_room"]

# The child's names: `root` (its argv[1]), `soft()` (its soft limit now), `hard`, `items(n)` (n one-tensor items)
UNDER_256 = """
import resource, sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

root = sys.argv[1]
soft = lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0]
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
items = lambda n: {f"k{i}": {"t": torch.full((3,), float(i))} for i in range(n)}
"""

# A child's start that defines `hold_every_descriptor()` (opens /dev/null until the limit refuses; returns the
# descriptors, for the child to close) and `report(calls)`: each call's name, then "done" or its error's type,
# errno, message and notes, on one line.
OUT_OF_DESCRIPTORS = """
import os


def hold_every_descriptor():
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        return held


def report(calls):
    for name, call in calls.items():
        try:
            call()
            print(name, "done")
        except BaseException as exc:
            notes = " | ".join(getattr(exc, "__notes__", ()))
            said = f"{exc} NOTES {notes}".replace("\\n", " ")
            print(name, type(exc).__name__, getattr(exc, "errno", None), said, flush=True)
"""


def skip_without_room(hard_at_least: int) -> None:
    """Skip where the soft limit cannot be raised as the test needs: the loads count /proc/self/fd (Linux's),
    and a hard limit below `hard_at_least` leaves no room to raise the soft one."""
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/fd is Linux's")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < hard_at_least:
        pytest.skip(f"the hard limit of open files ({hard}) leaves no room to raise the soft one")


def run_under_256(code: str, tmp_path: Path, *, hard_at_least: int) -> str:
    """`UNDER_256` then `code` in a new interpreter (its `root`: `tmp_path`); what it printed on stdout, then on
    stderr. A child that exits non-zero fails the test with its output."""
    skip_without_room(hard_at_least)
    done = fresh_process(UNDER_256 + code, str(tmp_path), timeout=300)
    return f"{done.stdout}\n{done.stderr}"
