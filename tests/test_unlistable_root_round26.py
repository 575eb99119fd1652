"""A run's root this user may not list (`chmod 711`, or 700 by another user), as an ordinary user meets it.

Before: `ls`, `gc` and `prune` answered "[Errno 13] Permission denied: 'run'" and `latest_checkpoint` raised the
same bare `PermissionError`: the OS's words, naming no fix. Now each names the directory and the fix (read and
search permission, or run as its owner), still a `PermissionError` (exit 2), never "no checkpoint". Root
ignores permissions, so the checks run in a child that drops to an unprivileged user.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.test_unreadable_files_round24 import run_as_nobody
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

CHILD = """
import contextlib, io, json, os, sys
from torch_checkpointing import cli, latest_checkpoint
run = sys.argv[1]
cli.main(["--plain", "ls", os.path.dirname(run)])  # imports what the commands import, while root can
cli.main(["--plain", "gc", "--dry-run", os.path.dirname(run)])
os.setgid(%(nobody)d)
os.setuid(%(nobody)d)
out = {}
for command in (["ls"], ["gc", "--dry-run"], ["prune", "--keep-last", "1"]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["--json", command[0], run, *command[1:]])
    out[command[0]] = {"code": code, **json.loads(stdout.getvalue())}
try:
    latest_checkpoint(run)
    out["latest"] = {"kind": "answered", "error": ""}
except Exception as exc:
    out["latest"] = {"kind": type(exc).__name__, "error": str(exc)}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="drops to another user: needs root")
@pytest.mark.parametrize("mode", [0o711, 0o700])
def test_a_root_this_user_may_not_list_is_said_so_with_the_fix(mode: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="round26-unlistable-root-"))
    try:
        run = base / "run"
        with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
            manager.save(str(run / "step_1"), {"model": {"w": torch.ones(4)}})
        for p in [base, *base.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(run, mode)
        result = run_as_nobody(CHILD, str(run))
        assert (run / "step_1" / "manifest.json").exists()  # prune deleted nothing
    finally:
        shutil.rmtree(base)
    for what, outcome in result.items():
        assert outcome.get("code", 2) == 2 and outcome["kind"] == "PermissionError", (what, outcome)
        assert f"Cannot list {run}" in outcome["error"], (what, outcome)
        assert "read and search permission" in outcome["error"] and "run as its owner" in outcome["error"], outcome
