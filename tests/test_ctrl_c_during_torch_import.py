"""Ctrl-C (or SIGTERM) while a command is still importing torch (seconds of C++ on a cold start).

A KeyboardInterrupt raised inside torch's C++ import does not come out as itself: measured by signalling
`python -c "import torch"` at 60 delays, it was swallowed (exit 0, the import went on), turned into
`ImportError: cannot load module more than once per process` (torch had tried numpy and cleared the error) or
aborted the process from C++ (`terminate called ... KeyboardInterrupt`). CI saw the ImportError from
`python -m simulator`. These tests make the landing point deterministic: a meta path finder sends the process
SIGINT as torch's import begins and then does what torch's C++ did with the KeyboardInterrupt, before letting the
real import go on. Both commands must end as a Ctrl-C does anywhere else in them: one line, exit code 130.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What torch's C++ did with the KeyboardInterrupt in the runs above.
_SWALLOW = "pass"
_TURN_INTO_IMPORT_ERROR = "raise ImportError('cannot load module more than once per process')"

_PRELUDE = """
import os, signal, sys, time

# A command typed at a terminal: Ctrl-C unblocked, with Python's own handler. A process started from a test
# worker may inherit SIGINT ignored or blocked (its launcher's state), which no terminal gives.
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
signal.signal(signal.SIGINT, signal.default_int_handler)

class _SignalDuringTorchImport:
    fired = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self.fired:
            return None
        self.fired = True
        try:
            os.kill(os.getpid(), signal.{signal_name})  # Python runs the handler as os.kill returns, or soon after
            for _ in range(2000):
                time.sleep(0.001)
        except KeyboardInterrupt:
            {what_torch_did}
        return None  # the real finders import torch

sys.meta_path.insert(0, _SignalDuringTorchImport())
"""

_COMMANDS = {
    # `--world 0` is refused once torch is imported: a Ctrl-C that was swallowed shows as that usage error.
    "simulator": "from simulator.cli import main\nsys.exit(main(['--world', '0']))",
    "torch-checkpointing": "sys.argv = ['torch-checkpointing', 'ls', {root!r}]\n"
    "from torch_checkpointing.__main__ import run\nsys.exit(run())",
}


def _run(command: str, signal_name: str, what_torch_did: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    prelude = textwrap.dedent(_PRELUDE).format(signal_name=signal_name, what_torch_did=what_torch_did)
    code = prelude + _COMMANDS[command].format(root=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", sorted(_COMMANDS))
@pytest.mark.parametrize(
    "what_torch_did", [_SWALLOW, _TURN_INTO_IMPORT_ERROR], ids=["swallowed", "turned-into-ImportError"]
)
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_torch_import_ends_the_command_as_interrupted(
    command: str, signal_name: str, what_torch_did: str, tmp_path: Path
) -> None:
    """Defect: the swallowed Ctrl-C let the command run on (here: to a usage error, exit 2, or a listing, exit
    0); the ImportError came out as a traceback with exit code 1. SIGTERM killed either command outright (-15,
    nothing said), though both promise 143 and one line for it."""
    done = _run(command, signal_name, what_torch_did, tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    said = "interrupted" if signal_name == "SIGINT" else "SIGTERM"
    expected = 128 + getattr(signal, signal_name)
    assert done.returncode == expected, f"exit code {done.returncode}, stderr:\n{done.stderr[-3000:]}"
    assert len(lines) == 1 and said in lines[0], f"stderr should be one line, got:\n{done.stderr[-3000:]}"
    assert done.stdout == "", f"the command went on after the Ctrl-C: {done.stdout[-2000:]}"
