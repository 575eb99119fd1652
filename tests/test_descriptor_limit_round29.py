"""Putting back the soft limit of open files never lowers it below what the job set itself meanwhile.

Loads raise the soft RLIMIT_NOFILE and the last one in flight puts it back. A job that set its own limit while a
load was in flight keeps it; before, a second load that raised the limit again (past the job's) made the last
load put back the limit from before the first, below what the job had set.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.probes import REPO

_SCRIPT = """
import resource, sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

root = sys.argv[1]
soft = lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0]
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    for name in ("a", "b"):
        m.save(f"{root}/{name}", {f"k{i}": {"t": torch.full((3,), float(i))} for i in range(150)})
first = CheckpointReadContext(storage, f"{root}/a", ReadPolicy()).__enter__()
print("raised by the first:", soft(), flush=True)
mine = soft() + 100
resource.setrlimit(resource.RLIMIT_NOFILE, (mine, hard))  # the job sets its own, a load in flight
second = CheckpointReadContext(storage, f"{root}/b", ReadPolicy()).__enter__()
print("raised by the second:", soft(), flush=True)
second.close()
first.close()
print("the job's own:", mine, "after both:", soft(), flush=True)
assert soft() >= mine, f"put back to {soft()}, below the {mine} the job set"
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
def test_a_limit_set_while_a_load_is_in_flight_is_never_lowered(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard limit of open files ({hard}) leaves no room to raise the soft one")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    out = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, out
    assert "raised by the second" in out, out


_CTRL_C_WHILE_RAISING = """
import logging, os, resource, signal, sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

root = sys.argv[1]
soft = lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0]
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

class CtrlC(logging.Handler):  # Ctrl-C comes as the load says it raised the limit
    def emit(self, record):
        if "Raised this process's soft limit" in record.getMessage():
            os.kill(os.getpid(), signal.SIGINT)

with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    m.save(f"{root}/big", {f"k{i}": {"t": torch.full((3,), float(i))} for i in range(150)})
    logger = logging.getLogger("torch_checkpointing")
    logger.setLevel(logging.INFO)
    ctrl_c = CtrlC()
    logger.addHandler(ctrl_c)
    try:
        m.load(f"{root}/big")
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    logger.removeHandler(ctrl_c)
    print("after the interrupted load:", soft(), flush=True)
    m.load(f"{root}/big")
    print("after the next load:", soft(), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
def test_a_load_interrupted_as_it_raised_the_limit_leaves_it_to_be_put_back(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard limit of open files ({hard}) leaves no room to raise the soft one")
    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_RAISING, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, out
    assert "interrupted" in out, out
    assert "after the interrupted load: 256" in out, out
    assert "after the next load: 256" in out, out
