"""gc short of file descriptors puts back no copy and deletes none: a shortage is doubt, never "not whole".

`asides._commit_time_if_whole` read any `OSError` met checking a copy aside as "not a whole checkpoint". Two copies
of an id aside (a replace killed between its renames, the id saved again, and a second replace killed the same
way), the newer one holding more files than a process with few descriptors to spare could open at once: gc put the
OLDER copy back under the id, and then deleted the newer one as a replaced copy of a committed id. Now the shortage
is raised: gc leaves both copies as they are (and says so), for a run with descriptors to settle. Real processes:
the replaces are SIGKILLed, gc runs in a child whose limit of open files (soft and hard) is low.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tests.test_long_names_and_removal import SUBPROCESS_TIMEOUT_S, _manager
from tests.test_put_back_asides import _killed_replace, _save

_GC_SHORT_OF_DESCRIPTORS = """
import os, resource, sys
from torch_checkpointing.retention import collect_garbage
import torch_checkpointing.asides  # every import gc needs, made while descriptors are there
limit = len(os.listdir("/proc/self/fd")) + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # the hard one too: gc cannot raise it
try:
    report = collect_garbage(sys.argv[1], unowned_after_s=0)
    print("done", [lo.path for lo in report.removed], report.failed)
except (OSError, MemoryError) as exc:
    print("raised", type(exc).__name__, exc)
"""


def test_gc_short_of_descriptors_neither_puts_back_the_older_copy_nor_deletes_the_newer(tmp_path: Path) -> None:
    """Defect: the older copy (one file) went back under the id and the newer one (40 files), whose check ran out of
    descriptors, was removed as garbage: the id held the older checkpoint, and the newer one was gone."""
    ckpt = tmp_path / "latest"
    _save(ckpt, 1.0)
    older = _killed_replace(ckpt, 2.0, "between")  # holds 1.0, in one file; nothing at the id
    with _manager() as manager:
        manager.save(str(ckpt), {f"k{i}": {"t": torch.ones(3)} for i in range(40)}, step=1)
    newer = _killed_replace(ckpt, 4.0, "between")  # holds the 40 files; nothing at the id
    done = subprocess.run(
        [sys.executable, "-c", _GC_SHORT_OF_DESCRIPTORS, str(tmp_path), "16"],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert newer.is_dir() and (newer / "manifest.json").is_file(), done.stdout
    assert older.is_dir() and not ckpt.exists(), done.stdout  # nothing put back on a guess
