"""A file inside a checkpoint this user may not read (`chmod 600` by another user), as an ordinary user meets it:
its bytes are unknown, not damaged, so nothing may call the checkpoint damaged (an operator deletes those).

Before: opening it raised `CorruptCheckpointError` ("Cannot open ...: Permission denied") with no fix, `verify`
said FAILED (exit 1), `ls` showed the checkpoint as DAMAGED and `latest_checkpoint` warned of "a damaged
checkpoint". Root ignores permissions, so the checks run in a child that drops to an unprivileged user.
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
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

SUBPROCESS_TIMEOUT_S = 300
NOBODY = 65534


def run_as_nobody(child: str, *args: str) -> Any:
    """What `child` (Python code that drops to `NOBODY`, given as `%(nobody)d`) printed on its `RESULT ` line."""
    done = subprocess.run(
        [sys.executable, "-c", child % {"nobody": NOBODY}, *args],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


CHILD = """
import contextlib, io, json, logging, os, sys
from torch_checkpointing import CheckpointManager, latest_checkpoint
from torch_checkpointing import cli
run = sys.argv[1]
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("torch_checkpointing").addHandler(handler)
cli.main(["--plain", "ls", run])  # imports what the commands import, while root can
os.setgid(%(nobody)d)
os.setuid(%(nobody)d)
out = {"loads": {}, "commands": {}}
latest = latest_checkpoint(run)
out["latest"] = None if latest is None else os.path.basename(latest.path)
out["warnings"] = list(records)
for name in ("step_2", "step_3", "step_4"):
    try:
        CheckpointManager(CheckpointManager.Config()).load(os.path.join(run, name))
        out["loads"][name] = {"kind": "loaded", "text": ""}
    except Exception as exc:
        permission = isinstance(exc, PermissionError)
        out["loads"][name] = {"kind": type(exc).__name__, "text": str(exc), "permission": permission}
for command in (["verify", "step_2"], ["verify", "step_3"], ["verify", "step_4"], ["inspect", "step_3"], ["ls"],
                ["ls", "../solo"]):
    stdout, stderr = io.StringIO(), io.StringIO()
    where = [os.path.join(run, c) for c in command[1:]] or [run]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["--plain", command[0], *where])
    out["commands"][" ".join(command)] = {"code": code, "text": stdout.getvalue() + stderr.getvalue()}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture
def run_root() -> Iterator[Path]:
    """Four checkpoints under a folder an unprivileged user can reach: step_2's data file and step_3's manifest
    readable by their owner only, step_4's directory searchable but not readable by others."""
    base = Path(tempfile.mkdtemp(prefix="round24-unreadable-files-"))
    try:
        run = base / "run"
        with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
            for step in (1, 2, 3, 4):
                manager.save(str(run / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}})
            manager.save(str(base / "solo" / "step_1"), {"model": {"w": torch.ones(4)}})
        for p in [base, *base.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(run / "step_2" / "model_0.pt", 0o600)
        os.chmod(run / "step_3" / "manifest.json", 0o600)
        os.chmod(base / "solo" / "step_1" / "model_0.pt", 0o600)
        os.chmod(run / "step_4", 0o711)  # searchable, not readable: its directory cannot be opened
        yield run
    finally:
        shutil.rmtree(base)


def _as_unprivileged_user(run: Path) -> dict[str, dict[str, dict[str, object]] | object]:
    result: dict[str, dict[str, dict[str, object]] | object] = run_as_nobody(CHILD, str(run))
    return result


def _says_unreadable(text: str, path: Path) -> None:
    """Names the file, the OS's reason and the fix, and never calls it damage."""
    assert str(path) in text and "Permission denied" in text, text
    assert "run as its owner" in text and "read permission" in text, text
    assert "damaged" not in text.lower() and "corrupt" not in text.lower(), text


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="drops to another user: needs root")
def test_a_file_this_user_may_not_read_is_said_unreadable_not_damaged(run_root: Path) -> None:
    out = _as_unprivileged_user(run_root)
    data, manifest = run_root / "step_2" / "model_0.pt", run_root / "step_3" / "manifest.json"
    loads = out["loads"]
    assert isinstance(loads, dict)
    for name, path in (("step_2", data), ("step_3", manifest), ("step_4", run_root / "step_4")):
        assert loads[name]["permission"] is True, loads[name]  # a PermissionError, not a CheckpointError
        _says_unreadable(str(loads[name]["text"]), path)
    commands = out["commands"]
    assert isinstance(commands, dict)
    # verify's exit 1 and FAILED mean "the bytes do not match": it could not look, so exit 2, as for a closed directory.
    checks = [("verify step_2", data), ("verify step_3", manifest), ("verify step_4", run_root / "step_4")]
    for command, path in [*checks, ("inspect step_3", manifest)]:
        said = commands[command]
        assert said["code"] == 2, (command, said)
        _says_unreadable(str(said["text"]), path)
        assert "FAILED" not in str(said["text"]) and "Traceback" not in str(said["text"]), (command, said)
    # A resume skips them out loud, never as damage; ls shows them as unreadable, not DAMAGED.
    assert out["latest"] == "step_1"
    warnings = out["warnings"]
    assert isinstance(warnings, list)
    for path in (data, manifest):
        said = [w for w in warnings if str(path) in w]
        assert said, warnings
        for w in said:
            _says_unreadable(w, path)
    ls = commands["ls"]
    assert ls["code"] == 0 and "DAMAGED" not in str(ls["text"]), ls
    assert "UNREADABLE step_2" in str(ls["text"]) and "UNREADABLE step_4" in str(ls["text"]), ls
    solo = commands["ls ../solo"]  # its one checkpoint unreadable: no resume point, and none is damaged
    assert solo["code"] == 0 and "UNREADABLE step_1" in str(solo["text"]), solo
    assert "damaged" not in str(solo["text"]).lower(), solo
