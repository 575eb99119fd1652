"""A removal whose first step, the rename aside, the OS refuses names the fix, as a refused removal does.

gc moves a leftover to a trash name and prune renames a checkpoint to one before either removes anything; where
the OS refused that rename (a folder this user may not write, a read-only mount, an immutable file) the report
said only "could not move ... aside ([Errno 13] Permission denied ...); left as it was" (prune: "rename
failed: ..."), though every later run meets the same refusal. The refusal here is real: the commands run as an
unprivileged user in a child, in a run's root that belongs to root.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.test_unreadable_files_round24 import run_as_nobody
from torch_checkpointing import CheckpointManager
from torch_checkpointing.manifest import INCOMPLETE_MARKER

CHILD = """
import contextlib, io, json, os, sys
from torch_checkpointing import cli
root = sys.argv[1]
cli.main(["--plain", "ls", root])  # imports what the commands import, while root can
import encodings.ascii
os.setgid(%(nobody)d)
os.setuid(%(nobody)d)
out = {}
for argv in (["gc", "--older-than", "0", root], ["prune", "--keep-last", "1", root]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["--json", *argv])
    out[argv[0]] = {"code": code, "doc": json.loads(stdout.getvalue())}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture
def closed_root() -> Iterator[Path]:
    """A root only root may write, holding two checkpoints and a dead save's temporary."""
    base = Path(tempfile.mkdtemp(prefix="round36-rename-refused-"))
    try:
        root = base / "run"
        manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
        try:
            for step in (1, 2):
                manager.save(str(root / f"step_{step}"), {"model": {"w": torch.ones(2)}})
        finally:
            manager.close()
        temporary = root / ".step_3.tmp-0123456789ab-1"
        temporary.mkdir()
        (temporary / INCOMPLETE_MARKER).touch()
        os.chmod(base, 0o755)
        os.chmod(root, 0o755)
        yield root
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="drops to another user: needs root")
def test_a_refused_rename_says_how_to_lift_it(closed_root: Path) -> None:
    out = run_as_nobody(CHILD, str(closed_root))
    gc = out["gc"]
    assert gc["code"] == 1, gc
    (failed,) = gc["doc"]["failed"]
    assert "Permission denied" in failed["reason"] and "run gc as the owner" in failed["reason"], failed
    prune = out["prune"]
    assert prune["code"] == 1, prune
    (kept,) = prune["doc"]["failed"]
    assert "Permission denied" in kept["reason"] and "run gc as the owner" in kept["reason"], kept
    assert sorted(p.name for p in closed_root.iterdir()) == [".step_3.tmp-0123456789ab-1", "step_1", "step_2"]
