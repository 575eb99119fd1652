"""A signal that lands after a CLI command has finished and written its whole report (round 34).

The command's outcome is decided once its report is out; the interpreter's exit after it (torch's teardown,
about half a second) is no part of the command. A SIGTERM (`timeout`, a scheduler) or Ctrl-C landing there
killed the process by the signal's default action: exit 143 or 130 with no line on stderr, for a command that
had done its work and said so (a prune whose deletions were reported, an export that was complete), which a
script reads as a command stopped midway.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 120  # the CLI takes seconds (importing torch); this only stops a hang


def _run_root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(root / "step_1"), {"model": {"w": torch.ones(2)}})
    return root


def _ls_json(root: Path) -> subprocess.Popen[str]:
    """`torch-checkpointing --json ls root`, in its own session: our own Ctrl-C handling, SIGINT at its default,
    as from a terminal."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch_checkpointing", "--json", "ls", str(root)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _whole_report(stdout: object) -> dict[str, object]:
    """Read the --json document line by line until it parses: the command has then written all of it."""
    text = ""
    for line in stdout:  # type: ignore[attr-defined]
        text += line
        try:
            return json.loads(text)  # type: ignore[no-any-return]
        except json.JSONDecodeError:
            continue
    raise AssertionError(f"the CLI ended before a whole JSON document: {text!r}")


# After the reader has the whole report, how long the signal waits: the command still has to return from the
# write that sent the report's last bytes and note its result decided (a signal landing in that moment is one
# during the command, and stops it), and the interpreter's exit (~0.5 s of torch's teardown) is the window meant.
_AFTER_THE_REPORT_S = 0.2


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_after_the_whole_report_keeps_the_commands_exit_code(tmp_path: Path, signum: int) -> None:
    root = _run_root(tmp_path)
    for _ in range(3):  # again where the process had ended before the signal went (a fast machine)
        proc = _ls_json(root)
        try:
            report = _whole_report(proc.stdout)
            assert report["latest"] == str(root / "step_1"), report
            time.sleep(_AFTER_THE_REPORT_S)
            sent = proc.poll() is None
            if sent:
                proc.send_signal(signum)
            _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if sent:
            break
    assert sent, "the process ended before the signal could be sent"
    assert proc.returncode == 0, (proc.returncode, stderr)
    assert "interrupted" not in stderr and "terminated" not in stderr, stderr


def _caught(pid: int, signum: int) -> bool:
    """Whether process `pid` runs a handler of its own for `signum` (its /proc status): once Python's
    finalization has put its handlers back, a signal takes its default action there, or is ignored."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "SigCgt":
            return bool(int(value.strip(), 16) & (1 << (signum - 1)))
    raise KeyError("SigCgt")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a process's signal masks from /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_the_interpreters_finalization_keeps_the_commands_exit_code(tmp_path: Path, signum: int) -> None:
    """Sent once the process no longer catches the signal: Python's finalization puts every handler it set back
    to the default action, before torch's teardown (the half second the command's end waits on)."""
    root = _run_root(tmp_path)
    proc = _ls_json(root)
    stderr = signal_once_uncaught(proc, signum, _whole_report)
    assert proc.returncode == 0, (proc.returncode, stderr)


def signal_once_uncaught(proc: subprocess.Popen[str], signum: int, read_report: Callable[[Any], object]) -> str:
    """Read `proc`'s report (`read_report(proc.stdout)`), send `signum` the moment `proc` no longer catches it (its
    interpreter's finalization), and wait for it to end; its stderr. Fails where it ended before that moment."""
    sent = False
    try:
        read_report(proc.stdout)
        while proc.poll() is None:
            try:
                if not _caught(proc.pid, signum):
                    proc.send_signal(signum)
                    sent = True
                    break
            except (FileNotFoundError, ProcessLookupError, KeyError):  # gone meanwhile, or a zombie's status
                break
        _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sent, "the process ended before it stopped catching the signal"
    return str(stderr)
