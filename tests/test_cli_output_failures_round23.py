"""The command line when its standard output cannot be written: a full disk under `> report.txt` (/dev/full
here), or stdout closed outright (`>&-`, as some cron and daemon setups start a command).

Before: `prune ROOT --keep-last 1 > /dev/full` deleted the checkpoints and then said only
"error: [Errno 28] No space left on device", which reads as the checkpoints' disk being full and the prune
having failed; with stdout closed, `ls` died at start with `AttributeError: 'NoneType' object has no
attribute 'isatty'` and `--json gc` did its work and then died with a traceback. Now the command's work stands,
and one line on stderr names standard output, the OS error and the fix; exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch
FULL = "/dev/full"


def _run(root: Path, count: int) -> Path:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in range(1, count + 1):
            manager.save(str(root / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}})
    return root


def _cli(argv: list[str], stdout: str) -> subprocess.CompletedProcess[str]:
    """The command with stdout sent to /dev/full ("full") or closed ("closed")."""
    command = [sys.executable, "-m", "torch_checkpointing", *argv]
    if stdout == "full":
        with open(FULL, "w") as out:
            return subprocess.run(
                command, cwd=REPO, stdout=out, stderr=subprocess.PIPE, text=True, timeout=SUBPROCESS_TIMEOUT_S
            )
    shell = ["sh", "-c", 'exec "$@" >&-', "sh", *command]  # the shell's `>&-`: fd 1 is not open at all
    return subprocess.run(shell, cwd=REPO, stderr=subprocess.PIPE, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def _assert_names_stdout(done: subprocess.CompletedProcess[str], why: str) -> None:
    err = done.stderr
    assert done.returncode == 2, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "standard output" in err and why in err, err
    assert err.count("\n") == 1, err  # one line


def _need_dev_full() -> None:
    if not os.path.exists(FULL):
        pytest.skip(f"{FULL} is not on this system")


@pytest.mark.parametrize("json_mode", [False, True], ids=["text", "json"])
def test_a_prune_whose_report_cannot_be_written_says_so_and_its_deletions_stand(
    tmp_path: Path, json_mode: bool
) -> None:
    _need_dev_full()
    root = _run(tmp_path / "run", 3)
    argv = (["--json"] if json_mode else []) + ["prune", str(root), "--keep-last", "1"]
    done = _cli(argv, "full")
    _assert_names_stdout(done, "No space left on device")
    assert "not undone" in done.stderr, done.stderr  # the deletions happened: not "prune failed, disk full"
    assert [c.name for c in list_checkpoints(root)] == ["step_3"]


@pytest.mark.parametrize(
    "argv",
    [["ls"], ["--json", "ls"], ["--json", "gc"], ["gc", "--dry-run"]],
    ids=["ls", "json-ls", "json-gc", "gc-dry-run"],
)
def test_a_command_with_stdout_closed_names_it_without_a_traceback(tmp_path: Path, argv: list[str]) -> None:
    root = _run(tmp_path / "run", 1)
    done = _cli([*argv, str(root)], "closed")
    _assert_names_stdout(done, "closed")
    assert [c.name for c in list_checkpoints(root)] == ["step_1"]


def test_ls_into_a_full_disk_names_stdout_not_the_checkpoints(tmp_path: Path) -> None:
    _need_dev_full()
    root = _run(tmp_path / "run", 2)
    _assert_names_stdout(_cli(["ls", str(root)], "full"), "No space left on device")
