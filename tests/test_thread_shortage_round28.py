"""A process the OS refuses a thread is short of a resource, and says so (round 28).

Under a low address-space limit (RLIMIT_AS) there is room for a load's allocations but not for a new thread's
stack, and CPython says only `RuntimeError("can't start new thread")`: a load failed with that, named neither as a
shortage (a caller that retries with less catches `MemoryError`) nor with its fix. The shortage here is real: a
child under RLIMIT_AS, stepped up until the load succeeds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_LOAD_UNDER_LIMITS = r"""
import resource, sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
with CheckpointManager(config) as m:
    if sys.argv[2] == "save":
        m.save(sys.argv[1], {"model": {"w": torch.ones(1024)}, "opt": {"x": torch.ones(10)}})
        sys.exit(0)
    base = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    for room in range(0, 257, 2):  # MiB of address space beyond what the process holds
        resource.setrlimit(resource.RLIMIT_AS, (base + room * 2**20, resource.RLIM_INFINITY))
        try:
            m.load(sys.argv[1])
            print(room, "loaded")
            break
        except Exception as exc:
            print(room, type(exc).__name__, "fix-said" if "ulimit -v" in str(exc) else "-", str(exc)[:300])
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
"""

_POOL_UNDER_LIMITS = r"""
import resource
from torch_checkpointing.futures import WorkerPool
pool = WorkerPool(2, "round28")
ran = []
resource.setrlimit(resource.RLIMIT_AS, (int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize(),
                                       resource.RLIM_INFINITY))
try:
    pool.submit(ran.append, "refused")
    print("submitted")
except MemoryError as exc:
    print("MemoryError", "ulimit -v" in str(exc))
finally:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
pool.submit(ran.append, "later").result(timeout=60)
print("ran", ran)
"""


def _child(script: str, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's")
def test_a_load_refused_a_thread_is_a_memory_error_with_the_fix(tmp_path: Path) -> None:
    """Defect: `RuntimeError: can't start new thread` at every limit below the one a load succeeds at."""
    _child(_LOAD_UNDER_LIMITS, str(tmp_path / "ck"), "save")
    lines = _child(_LOAD_UNDER_LIMITS, str(tmp_path / "ck"), "load")
    assert lines[-1].endswith("loaded"), lines
    failures = [line.split(" ", 3) for line in lines[:-1]]
    assert failures, lines  # the premise: some limit refused the load something
    assert {(kind, said) for _, kind, said, _ in failures} == {("MemoryError", "fix-said")}, lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's")
def test_a_call_whose_thread_was_refused_is_not_run_later() -> None:
    """The refused call was queued all the same, and ran at the next call that started a thread."""
    assert _child(_POOL_UNDER_LIMITS) == ["MemoryError True", "ran ['later']"]
