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
verify = sys.argv[2] == "verified"
loading = CheckpointLoaderConfig(verify_checksums=verify)
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=loading)
with CheckpointManager(config) as m:
    m.save(sys.argv[1], {f"k{i}": {"t": torch.ones(3)} for i in range(12)})
    m.load(sys.argv[1])  # every import a load needs, done with descriptors to spare
    held = len(os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for spare in range(40):
        resource.setrlimit(resource.RLIMIT_NOFILE, (held + spare, hard))
        try:
            m.load(sys.argv[1])
            print(spare, "loaded")
            break
        except (CheckpointError, OSError) as exc:
            damage = isinstance(exc, CorruptCheckpointError)
            said = "named" if sys.argv[1] in str(exc) and "not found damaged" in str(exc) else "-"
            print(spare, type(exc).__name__, "damage" if damage else "not-damage", said, str(exc)[:160])
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
@pytest.mark.parametrize("verify", ["unverified", "verified"])
def test_a_load_out_of_descriptors_is_no_damage(tmp_path: Path, verify: str) -> None:
    """Every failure below the limit the load needs must name the checkpoint and say it was not found damaged, as
    an error no caller takes for damage; the load must then succeed once descriptors are there.

    Defect: CorruptCheckpointError "Cannot open .../k10_0.pt (item 'k10'): [Errno 24] Too many open files", and
    UndecodableFileError "File .../k0_0.pt for item 'k0' cannot be decoded (OSError: [Errno 24] Too many open
    files: '/proc/self/fd/31'); the file is damaged or crafted"."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_UNDER_LIMITS, str(tmp_path / "ck"), verify],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines and lines[-1].endswith("loaded"), done.stdout
    failures = lines[:-1]
    assert failures, "no limit was low enough to fail the load: the test shows nothing"
    wrong = [line for line in failures if " not-damage named " not in line]
    assert not wrong, "\n".join(wrong)
