"""A process out of file descriptors is told so by `latest_checkpoint`, never handed an older resume point.

`latest_checkpoint` opens every file of the newest checkpoint the way a load does, to pick one a resume can load;
a check that failed for any reason but a store's silence made the checkpoint "damaged" and passed it over. In a
process at its limit of open files, that was every checkpoint: `latest_checkpoint` returned an older one, or None
(a training script then starts from scratch, and its retention deletes the intact checkpoints), while warning
"Skipping checkpoint .../step_2 as a resume point: ... the checkpoint was not found damaged". The shortage here is
real: a child whose limit of open files (soft and hard: nothing can raise it) leaves a few beyond those open.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

_LATEST_UNDER_LIMIT = """
import os, resource, sys, torch
from torch_checkpointing import CheckpointManager, latest_checkpoint
from torch_checkpointing.config import SyncCheckpointSaverConfig
root = sys.argv[1]
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    for step in (1, 2):
        m.save(os.path.join(root, f"step_{step}"), {f"k{i}": {"t": torch.ones(3)} for i in range(40)})
assert latest_checkpoint(root).path.endswith("step_2")  # with descriptors to spare
limit = len(os.listdir("/proc/self/fd")) + 12
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
try:
    found = latest_checkpoint(root)
    print("returned", None if found is None else found.path)
except OSError as exc:
    print("OSError", exc.errno, str(exc))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
def test_latest_checkpoint_out_of_descriptors_raises_the_shortage(tmp_path: Path) -> None:
    """Defect: "returned None" (both checkpoints passed over as damaged), where the process, not the checkpoints,
    was short of descriptors."""
    done = subprocess.run(
        [sys.executable, "-c", _LATEST_UNDER_LIMIT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kind, code, message = [*done.stdout.strip().splitlines()[-1].split(" ", 2), "", ""][:3]
    assert (kind, code) == ("OSError", str(errno.EMFILE)), done.stdout + done.stderr[-2000:]
    assert str(tmp_path / "step_2") in message and "not found damaged" in message, message
