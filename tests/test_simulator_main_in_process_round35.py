"""`simulator.cli.main` called in a process that goes on after it (round 35).

The late-stop handlers (a signal after the verdict ends the process with the verdict's code) belong to the
process entry point (`python -m simulator`) only. Installed by `main()` itself, they stayed after it returned: a
caller's later Ctrl-C ended its whole process at once (`os._exit` with the old run's code, no traceback, no
`finally`), and its interpreter's exit ignored SIGINT and SIGTERM.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 120  # the simulator takes seconds (importing torch); this only stops a hang

_CALLER = """
import os, signal, sys
from simulator.cli import main
before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
code = main(["--world", "1", "--storage-url", "file:///proc/simulator-none"])
after = {s: signal.getsignal(s) for s in before}
print("RESTORED", code, after == before, flush=True)
try:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):  # the handler runs at the next instructions
        pass
    print("NOT-RAISED", flush=True)
except KeyboardInterrupt:
    print("CAUGHT", flush=True)
sys.exit(7)
"""


def test_main_in_process_leaves_the_callers_signal_handlers_as_they_were(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CALLER],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
        start_new_session=True,  # its signals at their defaults, as from a terminal
    )
    assert "RESTORED 1 True" in done.stdout, (done.stdout, done.stderr)
    assert "CAUGHT" in done.stdout, (done.stdout, done.stderr)
    assert done.returncode == 7, (done.returncode, done.stdout, done.stderr)
