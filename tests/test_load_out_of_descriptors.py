"""A process out of file descriptors during a load is told as that, never as a damaged checkpoint.

An open refused with EMFILE ("Too many open files") was a `CorruptCheckpointError` ("Cannot open <file>: [Errno
24]"), and torch's map of a file refused the same way was an `UndecodableFileError` ("the file is damaged or
crafted. Load an earlier checkpoint."): a caller that deletes damaged checkpoints, or falls back to an earlier one,
acted on an intact checkpoint because its own process held too many files. The shortage here is real: a child under
a lowered RLIMIT_NOFILE, stepped up one descriptor at a time until the load succeeds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_LOAD_UNDER_LIMITS = """
import os, resource, sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError, CorruptCheckpointError
path, verify, spare = sys.argv[1], sys.argv[2] == "verified", int(sys.argv[3])
loading = CheckpointLoaderConfig(verify_checksums=verify)
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=loading)
with CheckpointManager(config) as m:
    if not os.path.exists(path):
        m.save(path, {f"k{i}": {"t": torch.ones(3)} for i in range(12)})
    m.load(path)  # every import a load needs, done with descriptors to spare
    limit = len(os.listdir("/proc/self/fd")) + spare
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # the hard one too: the load cannot raise it
    try:
        m.load(path)
        print(spare, "loaded")
    except (CheckpointError, OSError) as exc:
        damage = isinstance(exc, CorruptCheckpointError)
        said = "named" if path in str(exc) and "not found damaged" in str(exc) else "-"
        print(spare, type(exc).__name__, "damage" if damage else "not-damage", said, str(exc)[:160])
"""


def _load_with_spare(path: Path, verify: str, spare: int) -> str:
    """One load in a fresh child whose limit of open files (soft and hard) leaves `spare` beyond those open."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_UNDER_LIMITS, str(path), verify, str(spare)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
@pytest.mark.parametrize("verify", ["unverified", "verified"])
def test_a_load_out_of_descriptors_is_no_damage(tmp_path: Path, verify: str) -> None:
    """Every failure below the limit the load needs must name the checkpoint and say it was not found damaged, as
    an `OSError` (what a handler for the shortage catches; an `ObjectStoreError` told to "load again once the
    storage works"); the load must then succeed once descriptors are there.

    Defect: CorruptCheckpointError "Cannot open .../k10_0.pt (item 'k10'): [Errno 24] Too many open files", and
    UndecodableFileError "File .../k0_0.pt for item 'k0' cannot be decoded (OSError: [Errno 24] Too many open
    files: '/proc/self/fd/31'); the file is damaged or crafted"."""
    lines = []
    for spare in range(0, 60, 3):
        lines.append(_load_with_spare(tmp_path / "ck", verify, spare))
        if lines[-1].endswith("loaded"):
            break
    assert lines[-1].endswith("loaded"), lines
    failures = lines[:-1]
    assert len(failures) > 3, f"too few limits failed the load to show anything: {lines}"
    wrong = [line for line in failures if " not-damage named " not in line or line.split()[1] != "OSError"]
    assert not wrong, "\n".join(wrong)
