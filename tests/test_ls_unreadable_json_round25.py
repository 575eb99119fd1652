"""`ls --json` must tell a checkpoint this user may not read from a damaged one, as the text listing does, and
must name every checkpoint it could not read, not only those it listed.

Before: a checkpoint whose data file or directory this user may not read was put under `"damaged"` (the text
listing said UNREADABLE): a script that deletes what `ls --json` calls damaged deleted a healthy checkpoint its
owner can load. A checkpoint whose manifest this user may not read was in no part of the document (and on no
line of the text listing): only a WARNING on stderr said it existed. Root ignores permissions, so `ls` runs in
a child that drops to an unprivileged user.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.test_unreadable_files_round24 import run_as_nobody, run_root
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

__all__ = ["run_root"]  # the fixture, shared with the round-24 tests: step_2..step_4 unreadable three ways

CHILD = """
import contextlib, io, json, os, sys
from torch_checkpointing import cli
run = sys.argv[1]
cli.main(["--plain", "ls", run])  # imports what the command imports, while root can
os.setgid(%(nobody)d)
os.setuid(%(nobody)d)
out = {}
for mode in ("--json", "--plain"):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main([mode, "ls", run])
    out[mode] = {"code": code, "stdout": stdout.getvalue()}
print("RESULT " + json.dumps(out))
"""


def _ls_as_unprivileged_user(run: Path) -> dict[str, dict[str, object]]:
    result: dict[str, dict[str, object]] = run_as_nobody(CHILD, str(run))
    return result


def _add_damaged_newest(run: Path) -> None:
    """step_5, readable by everybody, its data file cut short: damage, as a resume finds it."""
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(run / "step_5"), {"model": {"w": torch.full((4,), 5.0)}})
    os.chmod(run / "step_5", 0o755)
    for f in (run / "step_5").iterdir():
        os.chmod(f, 0o644)
    with open(run / "step_5" / "model_0.pt", "r+b") as f:
        f.truncate(10)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="drops to another user: needs root")
def test_ls_json_puts_unreadable_checkpoints_apart_from_damaged_ones(run_root: Path) -> None:
    _add_damaged_newest(run_root)
    out = _ls_as_unprivileged_user(run_root)
    said = out["--json"]
    assert said["code"] == 0, said
    doc = json.loads(str(said["stdout"]))
    # Only the truncated one is damaged: a script deleting these deletes nothing its owner can load.
    assert [d["name"] for d in doc["damaged"]] == ["step_5"], doc["damaged"]
    assert "model_0.pt" in doc["damaged"][0]["problem"], doc["damaged"]
    # Every checkpoint it could not read is named, the one whose manifest it may not open (not listed) too.
    unreadable = {d["name"]: d for d in doc["unreadable"]}
    assert sorted(unreadable) == ["step_2", "step_3", "step_4"], doc["unreadable"]
    for name, entry in unreadable.items():
        assert entry["path"] == str(run_root / name), entry
        assert "Permission denied" in entry["problem"] and "do not delete it" in entry["problem"], entry
    assert doc["latest"] == str(run_root / "step_1")
    text = out["--plain"]
    lines = str(text["stdout"]).splitlines()
    assert text["code"] == 0, text
    for name in ("step_2", "step_3", "step_4"):  # each on stdout, beside the table it is missing from or in
        assert any(line.startswith(f"UNREADABLE {name}: ") for line in lines), lines
    assert any(line.startswith("DAMAGED step_5: ") for line in lines), lines
