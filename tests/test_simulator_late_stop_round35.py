"""A signal that lands after the simulator has printed its report and verdict (round 35).

The run's outcome is decided once its verdict is out; what follows (removing the run directory, the
interpreter's exit with torch's teardown) is no part of it. A SIGTERM there killed the process by the default
action the simulator had put back (exit -15, no line), a Ctrl-C raised a KeyboardInterrupt in the exit: a
script read a run that had reported its verdict as one stopped midway.

The run here is refused by its store check (a `file://` location under /proc, where nothing can be created):
a real simulator process that prints a whole report and a FAIL verdict (exit 1) without launching ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli_exit_round34 import signal_once_uncaught

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 120  # the simulator takes seconds (importing torch); this only stops a hang
_AFTER_THE_VERDICT_S = 0.2  # the run directory's removal and the interpreter's exit are the window meant


def _refused_run(tmp_path: Path) -> subprocess.Popen[str]:
    """`python -m simulator` whose store check fails: a report, the verdict FAIL, exit code 1. In its own session,
    so that its signals are at their defaults, as from a terminal."""
    return subprocess.Popen(
        [sys.executable, "-m", "simulator", "--world", "1", "--storage-url", "file:///proc/simulator-none"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _read_to_the_verdict(stdout: object) -> str:
    text = ""
    for line in stdout:  # type: ignore[attr-defined]
        text += line
        if line.startswith("VERDICT:"):
            return text
    raise AssertionError(f"the simulator ended before its verdict: {text!r}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_after_the_verdict_keeps_the_runs_exit_code(tmp_path: Path, signum: int) -> None:
    for _ in range(3):  # again where the process had ended before the signal went (a fast machine)
        proc = _refused_run(tmp_path)
        try:
            assert "VERDICT: FAIL" in _read_to_the_verdict(proc.stdout)
            time.sleep(_AFTER_THE_VERDICT_S)
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
    assert proc.returncode == 1, (proc.returncode, stderr)
    assert "interrupted" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a process's signal masks from /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_the_interpreters_finalization_keeps_the_runs_exit_code(tmp_path: Path, signum: int) -> None:
    """Sent once the process no longer catches the signal: Python's finalization puts its handlers back."""
    proc = _refused_run(tmp_path)
    stderr = signal_once_uncaught(proc, signum, _read_to_the_verdict)
    assert proc.returncode == 1, (proc.returncode, stderr)
