"""A checkpoint directory this process may not look into (another user's, `chmod 700` by its owner), as an
ordinary user meets it: the engine cannot tell whether it is committed, so it must say so, naming the directory
and the fix, instead of reading it as a directory without a manifest.

Before: `os.path.exists` answered False for the manifest inside it, so `latest_checkpoint` silently resumed from
the checkpoint before it, and `load`, `verify`, `inspect` and `diff` said "no manifest.json: not a checkpoint".
Root ignores permissions, so the checks run in a child that drops to an unprivileged user once it has imported
everything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

SUBPROCESS_TIMEOUT_S = 300
NOBODY = 65534

CHILD = """
import contextlib, io, json, logging, os, sys
from torch_checkpointing import CheckpointManager, latest_checkpoint, list_checkpoints
from torch_checkpointing import cli
root = sys.argv[1]
hidden = os.path.join(root, sys.argv[2])
locked = os.path.join(root, "step_2")
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("torch_checkpointing").addHandler(handler)
cli.main(["--plain", "ls", root])  # imports what the commands import, while root can
if os.geteuid() == 0:
    os.setgid(%(nobody)d)
    os.setuid(%(nobody)d)
out = {}
latest = latest_checkpoint(root)
out["latest"] = None if latest is None else os.path.basename(latest.path)
out["warnings"] = list(records)
latest_checkpoint(root)  # a long job's next retention pass: named once, not at every pass
out["named_again"] = [r for r in records[len(out["warnings"]):] if locked in r]
try:
    CheckpointManager(CheckpointManager.Config()).load(locked)
    out["load"] = "loaded"
except Exception as exc:
    out["load"] = f"{type(exc).__name__}: {exc}"
for command in (["verify", locked], ["inspect", locked], ["diff", os.path.join(root, "step_1"), locked],
                ["ls", root], ["gc", root, "--dry-run"]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["--plain", *command])
    out[command[0]] = {"code": code, "text": stdout.getvalue() + stderr.getvalue()}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture
def run_root() -> Iterator[Path]:
    """Two checkpoints and a killed save's temporary directory under a folder an unprivileged user can reach
    (pytest's temporary root is private to its user), the newer checkpoint and the temporary one closed to
    everybody but their owner."""
    base = Path(tempfile.mkdtemp(prefix="round24-unreadable-"))
    try:
        run = base / "run"
        with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
            for step in (1, 2):
                manager.save(str(run / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}})
        hidden = run / ".step_3.tmp-0123456789ab-1"
        hidden.mkdir()
        (hidden / ".incomplete").write_bytes(b"")
        for p in [base, *base.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(run / "step_2", 0o700)
        os.chmod(hidden, 0o700)
        if os.geteuid() != 0:  # an ordinary user owns them: closed to the owner too
            os.chmod(run / "step_2", 0)
            os.chmod(hidden, 0)
        yield run
    finally:
        for p in [base, *base.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                os.chmod(p, 0o755)
        shutil.rmtree(base)


def _as_unprivileged_user(run: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD % {"nobody": NOBODY}, str(run), ".step_3.tmp-0123456789ab-1"],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, object] = json.loads(line[len("RESULT ") :])
    return result


@pytest.mark.skipif(not hasattr(os, "setuid"), reason="POSIX permissions")
def test_a_checkpoint_that_cannot_be_looked_into_is_said_not_taken_for_no_checkpoint(run_root: Path) -> None:
    out = _as_unprivileged_user(run_root)
    locked = str(run_root / "step_2")
    # A resume may go back a step only out loud: the WARNING names the directory and why.
    assert out["latest"] == "step_1"
    warnings = out["warnings"]
    assert isinstance(warnings, list)
    assert any(locked in w and "Permission denied" in w for w in warnings), warnings
    assert out["named_again"] == [], out["named_again"]
    # A load names the directory, the reason and the fix; never "not a checkpoint".
    load = str(out["load"])
    assert locked in load and "Permission denied" in load and "permission" in load.split("Permission denied")[1]
    assert "not a checkpoint" not in load, load
    # The commands cannot run on it: exit 2 (verify's 1 is for "looked, and it is no committed checkpoint").
    for command, code in (("verify", 2), ("inspect", 2), ("diff", 2)):
        said = out[command]
        assert isinstance(said, dict)
        assert said["code"] == code, (command, said)
        assert locked in said["text"] and "Permission denied" in said["text"], (command, said)
        assert "not a checkpoint" not in said["text"], (command, said)
        assert "Traceback" not in said["text"], (command, said)
    # Listing and gc still work for the rest of the root, and say what they could not look into.
    for command in ("ls", "gc"):
        said = out[command]
        assert isinstance(said, dict)
        assert said["code"] == 0, (command, said)
        assert "Traceback" not in said["text"], (command, said)
    assert "step_1" in str(out["ls"]) and "cannot be read (Permission denied)" in str(out["ls"])
    gc = out["gc"]
    assert isinstance(gc, dict)
    assert ".step_3.tmp-0123456789ab-1" in gc["text"] and "cannot be read" in gc["text"], gc
    assert "holds no manifest.json" not in gc["text"], gc
