"""The soft limit of open files is raised where a read needs it, and said once per raise (round 28).

A load raises the process's soft limit of open files (RLIMIT_NOFILE) to what its files need beside the
descriptors open now, and logs that at INFO. It was raised to that count exactly: each later load with a few
more descriptors open (a job's sockets, its logs) raised it again, and said so again, at every resume and every
retention pass. A listing (`latest_checkpoint`, `damage`: `discovery.problem_with` holds one descriptor per file
it checks) asked for a load's two per file, and raised the limit where the files fitted under it. A load now
puts the limit back once no load is in flight: each raise and each put-back is said once.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_UNDER_A_SOFT_LIMIT = r"""
import logging, os, resource, sys, torch
from torch_checkpointing import CheckpointManager, latest_checkpoint
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import damage
root, items, soft, case = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
raised = []
class Told(logging.Handler):
    def emit(self, record):
        if "soft limit of open files" in record.getMessage():
            raised.append(record.levelname)
logging.getLogger("torch_checkpointing").addHandler(Told())
logging.getLogger("torch_checkpointing").setLevel(logging.DEBUG)
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    m.save(f"{root}/step_1", {f"k{i}": {"t": torch.full((2,), float(i))} for i in range(items)})
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    for _ in range(3):
        if case == "listing":
            assert latest_checkpoint(root).step == 1 and damage(f"{root}/step_1") is None
        else:
            assert float(m.load(f"{root}/step_1")[f"k{items - 1}"]["t"][0]) == items - 1
            held += [os.open(os.devnull, os.O_RDONLY) for _ in range(8)]  # the job opens a few more meanwhile
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] > soft, raised)
"""


def _run(tmp_path: Path, items: int, soft: int, case: str) -> str:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard limit of open files ({hard}) leaves no room to raise the soft one")
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_A_SOFT_LIMIT, str(tmp_path / "run"), str(items), str(soft), case],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
def test_a_listing_whose_files_fit_leaves_the_limit(tmp_path: Path) -> None:
    """480 files under a soft limit of 1024. Defect: `True ['INFO']`, the limit raised to 1033 for a listing."""
    assert _run(tmp_path, 480, 1024, "listing") == "False []"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
def test_loads_with_more_descriptors_open_each_time_tell_each_raise_and_each_put_back_once(tmp_path: Path) -> None:
    """150 files under a soft limit of 256, 8 more descriptors open before each next load. The limit is put back
    once no load is in flight (round 28, `descriptors_released`), so each load raises it and puts it back: one
    INFO line for each, and the job's own limit is back at the end. Defect (before either change): `True
    ['INFO', 'INFO', 'INFO']`, the limit raised and kept for good."""
    assert _run(tmp_path, 150, 256, "loads") == f"False {['INFO'] * 6}"
