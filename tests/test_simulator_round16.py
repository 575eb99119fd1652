"""Round 16 attacks on `python -m simulator` as a user runs it: interruptions and how the run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _start(tmp_path: Path, *argv: str, code: str | None = None) -> tuple[subprocess.Popen[str], Path]:
    """The simulator (`python -m simulator`, or `code` run with `argv`) in its own session, with TMPDIR inside
    tmp_path so leftover temp dirs can be seen."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, *(["-m", "simulator"] if code is None else ["-c", code]), *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_signals_as_from_a_terminal,
    )
    return proc, tmpdir


def _signals_as_from_a_terminal() -> None:
    """In the child, before exec: every signal these tests send at their default, as a user's shell leaves them.
    A test run started in the background (`cmd &`, SIGINT ignored) or under `nohup` (SIGHUP ignored) passed that
    on, and the simulator rightly keeps an ignored signal ignored: the test then saw exit code 0."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


def _wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> list[str]:
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    pytest.fail(f"never printed {needle!r}; printed: {''.join(seen)[-2000:]}")


def _session_gone(pgid: int, timeout: float = 60.0) -> bool:
    """Whether every process of the simulator's session (ranks, writers) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _interrupt_and_check(proc: subprocess.Popen[str], tmpdir: Path, to_group: bool) -> None:
    if to_group:  # a terminal's Ctrl-C reaches every process in the foreground group, the ranks too
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    _check_interrupted(proc, tmpdir)


def _check_interrupted(proc: subprocess.Popen[str], tmpdir: Path, signum: int = signal.SIGINT) -> None:
    """The simulator interrupted by `signum` exits 128+signum with one line on stderr, no process of its session
    and no temp dir left."""
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip()]
    alive = not _session_gone(proc.pid)
    if alive:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, f"exit code {proc.returncode}, stderr:\n{err[-3000:]}"
    assert len(lines) == 1 and "interrupted" in lines[0], f"stderr should be one line, got:\n{err[-3000:]}"
    assert not alive, "rank or writer processes outlived the interrupted simulator"
    assert list(tmpdir.iterdir()) == [], f"temporary files left behind: {list(tmpdir.iterdir())}"


@pytest.mark.parametrize("to_group", [False, True], ids=["parent-only", "whole-group"])
def test_ctrl_c_while_ranks_run_exits_130_with_one_line_and_nothing_left(tmp_path: Path, to_group: bool) -> None:
    """Defect: SIGINT during a launch ended with exit code 1 and a 20-line SignalException traceback from
    torch's elastic launcher instead of the shell's 130 and one line saying the run was interrupted."""
    proc, tmpdir = _start(tmp_path, "--world", "2", "--scenario", "layouts", "--timeout", "120")
    _wait_for_line(proc, "layouts · started", timeout=120)
    _interrupt_and_check(proc, tmpdir, to_group)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGQUIT], ids=["sighup", "sigquit"])
def test_a_closed_terminal_while_ranks_run_stops_every_rank_with_one_line(tmp_path: Path, signum: int) -> None:
    """Round 25: SIGHUP (the terminal closed) or SIGQUIT (Ctrl-\\) during a launch killed the simulator at once
    and left its ranks running, with their temp dirs, once the ranks were spawned off the main thread: the
    handler torch's start_processes used to set for them on the main thread (kept after the spawn) was the
    only one. Each ends the run as SIGTERM does."""
    proc, tmpdir = _start(tmp_path, "--world", "2", "--scenario", "layouts", "--timeout", "120")
    _wait_for_line(proc, "layouts · started", timeout=120)
    proc.send_signal(signum)
    _check_interrupted(proc, tmpdir, signum)


def test_ctrl_c_before_any_rank_starts_exits_130_with_one_line(tmp_path: Path) -> None:
    """Defect: SIGINT while the simulator was still importing torch printed a KeyboardInterrupt traceback
    and exited 1."""
    proc, tmpdir = _start(tmp_path, "--world", "2", "--scenario", "layouts", "--timeout", "120")
    time.sleep(1.0)
    _interrupt_and_check(proc, tmpdir, to_group=False)


# The simulator, whose first rank's spawn is followed at once by a real signal (argv[1]: SIGINT, SIGTERM) to the
# simulator alone: a Ctrl-C or a SIGTERM that lands while the ranks are being started, deterministically.
_SIGNAL_DURING_SPAWN = """
import multiprocessing.context, os, signal, sys
real_start = multiprocessing.context.SpawnProcess.start
def start(process):
    real_start(process)
    multiprocessing.context.SpawnProcess.start = real_start  # once: the other ranks are started as usual
    os.kill(os.getpid(), signal.Signals[SIGNAL])
SIGNAL = sys.argv.pop(1)
multiprocessing.context.SpawnProcess.start = start
from simulator.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "sighup"])
def test_a_signal_while_the_ranks_are_spawned_stops_every_rank_with_one_line(tmp_path: Path, signum: int) -> None:
    """Round 25, a deterministic test of the signals held over the ranks' spawn (simulator/held_signals.py).
    The hold did not hold: torch's `start_processes` set its own handler over it, whose SignalException left the
    spawn after rank 0 had started and before the launcher had a handle on it. Nothing stopped that rank; the
    simulator said "ranks stopped, nothing left running", then the rank printed a multiprocessing traceback
    (FileNotFoundError in SemLock._rebuild) under it."""
    argv = (signal.Signals(signum).name, "--world", "2", "--scenario", "layouts", "--timeout", "120")
    proc, tmpdir = _start(tmp_path, *argv, code=_SIGNAL_DURING_SPAWN)
    _check_interrupted(proc, tmpdir, signum)


def test_a_keep_dir_that_cannot_be_created_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """Defect: `--keep` under a path that cannot hold a directory (a file, a read-only mount) ended in an
    OSError traceback from mkdir (or, for an existing read-only dir, every rank failing); bad input must be
    refused before anything starts, naming the flag and the fix."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = subprocess.run(
        [sys.executable, "-m", "simulator", "--world", "1", "--scenario", "layouts", "--keep", str(blocker / "k")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "--keep" in proc.stderr and "not a writable directory" in proc.stderr
    assert "launching" not in proc.stdout


_FORGETFUL_BACKEND = '''
"""torch_checkpointing whose load cannot read a checkpoint saved by another process (a lost-on-restart engine)."""
import sys
import torch_checkpointing as _tc
from torch_checkpointing import *  # noqa: F403

for _name in ("checkpoint_layout", "resharding", "dtensor_resharder", "distributed_metadata", "storage",
              "storage.base_storage", "storage.filesystem"):
    __import__(f"torch_checkpointing.{_name}")
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"torch_checkpointing.{_name}"]

_SAVED: set[str] = set()


class CheckpointManager(_tc.CheckpointManager):
    def save(self, checkpoint_id, *args, **kwargs):
        _SAVED.add(str(checkpoint_id))
        return super().save(checkpoint_id, *args, **kwargs)

    def load(self, checkpoint_id, *args, **kwargs):
        if str(checkpoint_id) not in _SAVED:
            raise RuntimeError(f"{checkpoint_id}: not saved by this process")
        return super().load(checkpoint_id, *args, **kwargs)
'''


def test_layouts_fails_an_engine_that_cannot_reload_on_the_world_that_saved(tmp_path: Path) -> None:
    """Defect: layouts/reload counted any exception from load as a safe refusal, so on 2→2 an engine that
    cannot read back its own checkpoint in fresh processes got `VERDICT: PASS` from `--scenario layouts`."""
    pkg = tmp_path / "forgetful_tc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(_FORGETFUL_BACKEND)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "simulator", "--world", "2", "--scenario", "layouts", "--backend", "forgetful_tc"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "layouts/read-back" in proc.stdout and "paths PASS, read-back PASS" in proc.stdout, proc.stdout[-3000:]
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "VERDICT: FAIL — layouts/reload" in proc.stdout, proc.stdout[-3000:]
    assert "not saved by this process" in proc.stdout
