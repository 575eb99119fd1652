"""Round 9: the operations an operator runs on a real job's root (`ls`, `prune`, `gc`), as subprocesses.

Each defect test failed before its fix: `ls` showed a checkpoint whose recorded file was gone as the newest row,
with nothing to say that `latest_checkpoint` (and a resume) skips it; `prune` that had to leave a checkpoint the
policy does not keep (it holds a file of somebody else's, here a link out of the root) printed only the ones it
deleted and exited 0, so `prune ... && echo pruned` reported success.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, latest_checkpoint, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch; a hang never ends


def _save_run(root: Path, steps: tuple[int, ...]) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in steps:
            state = {"model": {"w": torch.full((4,), float(step))}}
            manager.save(str(root / f"step_{step}"), state, step=step, metrics={"loss": 1.0 / step})


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch_checkpointing", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def _json_cli(*args: str) -> tuple[int, Any]:
    proc = _cli("--json", *args)
    return proc.returncode, json.loads(proc.stdout)


def _canary(tmp_path: Path) -> Path:
    """A directory outside every root with a file in it: no command may ever remove it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_text("alive")
    return outside


# ------------------------------------------------------------------------------------------------ ls


def test_ls_says_which_newer_checkpoints_a_resume_skips_and_why(tmp_path: Path) -> None:
    """The last row of `ls` is what an operator reads as "latest"; a half-deleted newest checkpoint must be
    marked as such, naming the missing file, and the row a resume uses must be named."""
    root = tmp_path / "run"
    _save_run(root, (9, 10, 100))
    (root / "step_100" / "model_0.pt").unlink()
    latest = latest_checkpoint(root)
    assert latest is not None and latest.name == "step_10"

    plain = _cli("ls", str(root))
    assert plain.returncode == 0, plain.stderr
    damaged = [line for line in plain.stdout.splitlines() if "step_100" in line and "DAMAGED" in line]
    assert damaged and "model_0.pt" in damaged[0] and "missing" in damaged[0], plain.stdout
    assert any("resume point" in line and line.endswith("step_10") for line in plain.stdout.splitlines())

    code, doc = _json_cli("ls", str(root))
    assert code == 0
    assert [c["name"] for c in doc["checkpoints"]] == ["step_9", "step_10", "step_100"]  # still listed
    assert doc["latest"] == latest.path
    assert [d["name"] for d in doc["damaged"]] == ["step_100"] and "model_0.pt" in doc["damaged"][0]["problem"]


def test_ls_of_an_intact_root_names_the_newest_as_the_resume_point(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _save_run(root, (9, 10, 100))
    code, doc = _json_cli("ls", str(root))
    assert code == 0 and doc["damaged"] == [] and doc["latest"] == str(root / "step_100")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, doc = _json_cli("ls", str(empty))
    assert code == 0 and doc == {
        "root": str(empty),
        "checkpoints": [],
        "latest": None,
        "damaged": [],
        "unreadable": [],
        "leftovers": [],
    }


# ------------------------------------------------------------------------------------------------ prune


def test_prune_that_must_leave_a_checkpoint_exits_1_and_names_it(tmp_path: Path) -> None:
    """A checkpoint the policy does not keep but that holds somebody else's file (a link to a directory outside
    the root) is left alone, rightly; `prune` must then say so and exit 1, and the link's target survives."""
    outside = _canary(tmp_path)
    root = tmp_path / "run"
    _save_run(root, (1, 2, 3, 4))
    os.symlink(outside, root / "step_1" / "mine")

    proc = _cli("prune", str(root), "--keep-last", "1")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "NOT DELETED step_1" in proc.stdout and "mine" in proc.stdout, proc.stdout
    assert "step_1" in proc.stderr  # the WARNING on the torch_checkpointing logger
    assert "Traceback" not in proc.stderr
    assert [c.name for c in list_checkpoints(root)] == ["step_1", "step_4"]
    assert (outside / "canary").read_text() == "alive"

    code, doc = _json_cli("prune", str(root), "--keep-last", "1")  # the same answer for scripts, every time
    assert code == 1 and doc["deleted"] == []
    assert [f["name"] for f in doc["failed"]] == ["step_1"] and "mine" in doc["failed"][0]["reason"]

    os.unlink(root / "step_1" / "mine")  # the fix the message names
    code, doc = _json_cli("prune", str(root), "--keep-last", "1")
    assert code == 0 and [d["name"] for d in doc["deleted"]] == ["step_1"] and doc["failed"] == []
    assert (outside / "canary").read_text() == "alive"


def test_prune_dry_run_says_what_the_real_run_would_leave(tmp_path: Path) -> None:
    """`--dry-run` listed a checkpoint holding a foreign file as "would delete"; the real run then left it."""
    outside = _canary(tmp_path)
    root = tmp_path / "run"
    _save_run(root, (1, 2, 3))
    os.symlink(outside / "canary", root / "step_1" / "notes.txt")
    code, doc = _json_cli("prune", str(root), "--keep-last", "1", "--dry-run")
    assert code == 1 and [d["name"] for d in doc["deleted"]] == ["step_2"]
    assert [f["name"] for f in doc["failed"]] == ["step_1"] and "notes.txt" in doc["failed"][0]["reason"]
    assert [c.name for c in list_checkpoints(root)] == ["step_1", "step_2", "step_3"]  # nothing deleted
    code, real = _json_cli("prune", str(root), "--keep-last", "1")
    assert code == 1 and (real["deleted"], real["failed"]) == (doc["deleted"], doc["failed"])
    assert (outside / "canary").read_text() == "alive"


def test_bad_prune_arguments_name_the_flag_not_the_python_field(tmp_path: Path) -> None:
    """`prune --keep-last 0` said "RetentionPolicy.keep_last must be a positive int", and `--keep-best 1`
    without a metric "needs metric=": an operator at a shell has flags, not fields."""
    root = tmp_path / "run"
    _save_run(root, (1, 2))
    for argv, flag in [
        (["--keep-last", "0"], "--keep-last"),
        (["--keep-every-n-steps", "-5"], "--keep-every-n-steps"),
        (["--keep-best", "1"], "--metric"),
    ]:
        proc = _cli("prune", str(root), *argv)
        assert proc.returncode == 2, proc.stderr
        assert flag in proc.stderr and "RetentionPolicy" not in proc.stderr and "metric=" not in proc.stderr
        assert "Traceback" not in proc.stderr
    assert [c.name for c in list_checkpoints(root)] == ["step_1", "step_2"]


# ------------------------------------------------------------------------------------------------ wrong roots


def test_a_file_as_the_root_of_latest_is_an_error_not_a_first_run(tmp_path: Path) -> None:
    """`latest_checkpoint(file)` returned None, which a resume reads as "no checkpoint yet": a misconfigured
    root (a checkpoint's file, a log) silently restarted training from step 0. A missing root still lists
    nothing (a first run)."""
    root = tmp_path / "run"
    _save_run(root, (1,))
    afile = root / "step_1" / "model_0.pt"
    for call in (latest_checkpoint, list_checkpoints):
        try:
            call(afile)
        except NotADirectoryError as exc:
            assert str(afile) in str(exc) and "pass the directory that holds the checkpoints" in str(exc)
        else:
            raise AssertionError(f"{call.__name__}({afile}) did not raise")
    assert latest_checkpoint(tmp_path / "not-yet") is None
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    # a link to nothing (an unmounted volume) is no first run: a save refuses it too (round 34)
    with pytest.raises(FileNotFoundError, match="dangling.* is a symbolic link to .*nowhere"):
        list_checkpoints(tmp_path / "dangling")


def test_a_checkpoint_passed_as_the_root_says_to_pass_its_parent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`latest_checkpoint("run/step_2")` (the checkpoint, not its root) listed nothing and said nothing."""
    (tmp_path / "empty-but-made").mkdir()
    root = tmp_path / "run"
    _save_run(root, (1, 2))
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert latest_checkpoint(root / "step_2") is None
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("is itself a checkpoint" in m and f"pass its parent directory {root}" in m for m in said), said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert latest_checkpoint(root).name == "step_2"  # type: ignore[union-attr]
        assert latest_checkpoint(tmp_path / "empty-but-made") is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    proc = _cli("ls", str(root / "step_2"))
    assert proc.returncode == 0 and "0 committed checkpoint(s)" in proc.stdout
    assert f"pass its parent directory {root}" in proc.stderr, proc.stderr
