"""A read short of file descriptors names no load in its fix when it is no load (round 36).

An export whose process ran out of descriptors was told "... the checkpoint was not found damaged (do not delete
it). Close files this process holds, or raise its limit (`ulimit -n`, RLIMIT_NOFILE), and load again." The
shortage is real: a child whose RLIMIT_NOFILE leaves no descriptor beyond those open.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_EXPORT_UNDER_LIMITS = """
import os, resource, shutil, sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.hf import export_hf
path, out = sys.argv[1], sys.argv[2]
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    m.save(path, {"model": {"t": torch.ones(3)}})
export_hf(path, "model", out)  # every import an export needs, done with descriptors to spare
shutil.rmtree(out)
limit = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
try:
    export_hf(path, "model", out)
    print("exported")
except OSError as exc:
    print(str(exc).replace(chr(10), " "))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
def test_an_export_out_of_descriptors_names_no_load(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EXPORT_UNDER_LIMITS, str(tmp_path / "ck"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip().splitlines()[-1]
    assert "Out of file descriptors" in said and "not found damaged" in said, said
    assert "load" not in said.lower() and "again" in said, said  # the fix: the same call again, whichever it is
