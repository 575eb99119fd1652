"""Round 26: the simulator's launch waited for its ranks' spawn without bound.

`launch()` counted its timeout only once every rank had started, and the spawn (on a thread of its own since
round 25, signals held meanwhile) blocks until each rank reads what it is handed. A rank whose interpreter
hung at startup (here a sitecustomize that sleeps; a stalled filesystem does the same) held `launch(...,
timeout=5)` for as long as it stayed stuck, Ctrl-C held too. Now the spawn is bounded by the launch's timeout:
a `LaunchError` names it, and the ranks it had started are killed.

Round 27: once that launch had ended, the spawn's thread stayed blocked for good (multiprocessing held the pipe's
other end until a killed rank had read its hand-over), and `LaunchError.failures` was `[]`, though every rank had
failed. The spawn now hands each rank only a path, so it never waits on a rank's startup: the launch's own
timeout names every rank, as one that never started.
"""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.multirank

_HANG_AT_STARTUP = """
import os, time
# A rank (multiprocessing's spawn_main), not the launcher's resource tracker, which it starts the same way.
rank = b"spawn_main" in open("/proc/self/cmdline", "rb").read()
if os.environ.get("RANK_STARTUP_PIDS") and rank:
    open(os.path.join(os.environ["RANK_STARTUP_PIDS"], f"{os.getpid()}.pid"), "w").close()
    time.sleep(300)
"""

_LAUNCHER = """
import os, sys, threading, time
from simulator.launcher import LaunchError, launch

def size(blob):
    return len(blob)

if __name__ == "__main__":
    os.environ["RANK_STARTUP_PIDS"] = sys.argv[1]  # the ranks' startup hangs, not this process's
    started = time.monotonic()
    try:
        launch(size, 2, args=(b"x" * (1 << 20),), timeout=5)  # more than a pipe holds: the spawn waits
        print("returned")
    except LaunchError as exc:
        print(f"LaunchError after {time.monotonic() - started:.1f}s: {exc}")
        time.sleep(1)  # a spawn that ends at all once its ranks are killed has ended by now
        print("FAILURES", repr([(f.rank, f.cause) for f in exc.failures]))
        print("THREADS", repr(sorted(t.name for t in threading.enumerate() if t.is_alive())))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] if Path("/proc").exists() else "R"
    return state != "Z"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[int], list[int]]:
    """One launch whose ranks hang at startup: what it printed, the stuck ranks' pids, those left running."""
    tmp_path = tmp_path_factory.mktemp("spawn_bound")
    site, pids, out = tmp_path / "site", tmp_path / "pids", tmp_path / "out.txt"
    site.mkdir()
    pids.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(_HANG_AT_STARTUP))
    (tmp_path / "launcher.py").write_text(textwrap.dedent(_LAUNCHER))
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), repo])}
    env.pop("RANK_STARTUP_PIDS", None)
    with open(out, "w") as sink:  # a file, not a pipe: a rank left running would hold a pipe open
        child = subprocess.Popen(
            [sys.executable, str(tmp_path / "launcher.py"), str(pids)], stdout=sink, stderr=subprocess.STDOUT, env=env
        )
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        finally:
            stuck = [int(p.stem) for p in pids.glob("*.pid")]
            left = [pid for pid in stuck if _alive(pid)]
            for pid in stuck:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return out.read_text(), stuck, left


def _printed(said: str, label: str) -> list[Any]:
    line = next((ln for ln in said.splitlines() if ln.startswith(label + " ")), None)
    assert line is not None, said[-2000:]
    return list(ast.literal_eval(line[len(label) + 1 :]))


def test_a_launch_whose_ranks_never_start_ends_within_its_timeout_and_kills_them(
    launched: tuple[str, list[int], list[int]],
) -> None:
    said, stuck, left = launched
    assert "LaunchError after" in said and "did not finish within 5s" in said, said[-2000:]
    assert float(said.split("LaunchError after ")[1].split("s")[0]) < 30, said[-2000:]
    assert stuck, "no rank got as far as its startup"
    assert not left, f"ranks left running once the launch had ended: {left}"


def test_the_launch_names_every_rank_as_never_started_and_leaves_no_thread_blocked(
    launched: tuple[str, list[int], list[int]],
) -> None:
    # Before: FAILURES [] and THREADS [..., 'simulator-step'] (the spawn's thread, blocked writing to a killed
    # rank's pipe for as long as the process lived).
    said = launched[0]
    failures = _printed(said, "FAILURES")
    assert [rank for rank, _ in failures] == [0, 1], said[-2000:]
    assert all("never started" in cause for _, cause in failures), failures
    assert "simulator-step" not in _printed(said, "THREADS"), said[-2000:]
