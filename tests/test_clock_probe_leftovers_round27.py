"""A clock probe that a killed process left behind is collected by gc, on a filesystem and on an object store.

Where gc, retention or a load judges an age it reads the store's "now" from a probe it writes there
(`base_storage.store_now`). On NFS (no O_TMPFILE) and on object stores that probe has a name,
`.clock-probe-{pid}-{nonce}-{host}`, and a process killed between its create and its removal left it in the
run's root for good: gc passed over it ("delete it by hand"), a root was never empty again, and every killed
job added one. Each test below makes the probe the way a killed process leaves it (a real process that made it
and is gone), runs gc, and checks it went; a live process's probe, and a user's file that only has the name,
stay.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3_server import S3Server, missing_s3_packages
from torch_checkpointing.names import host_tag, new_nonce
from torch_checkpointing.retention import collect_garbage

# Makes its probe's file the way `_probe_file_ctime` names it on NFS, says its name, then is killed there (no
# `sys.argv[2]`) or waits to be (with it): between the probe's create and its removal.
_PROBE = """
import os, signal, sys, time
from torch_checkpointing.storage.base_storage import clock_probe_name

path = os.path.join(sys.argv[1], clock_probe_name())
os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
print(path, flush=True)
if len(sys.argv) < 3:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""
_TIMEOUT_S = 60


def _probe_of(root: Path, *, killed: bool) -> tuple[subprocess.Popen[str], Path]:
    args = [sys.executable, "-c", _PROBE, str(root)] + ([] if killed else ["wait"])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    return child, Path(child.stdout.readline().strip())


def test_gc_removes_the_clock_probe_of_a_process_killed_while_it_probed(tmp_path: Path) -> None:
    """Failed before: the killed process's `.clock-probe-` file was still in the root after gc."""
    dead, left = _probe_of(tmp_path, killed=True)
    assert dead.wait(timeout=_TIMEOUT_S) == -signal.SIGKILL and left.exists()
    live, held = _probe_of(tmp_path, killed=False)
    foreign = tmp_path / f".clock-probe-{dead.pid}-{new_nonce()}-{host_tag()}"
    foreign.write_text("a user's notes, only named like a probe")
    try:
        report = collect_garbage(tmp_path)
        assert not left.exists(), report
        assert [Path(lo.path).name for lo in report.removed] == [left.name], report
        assert held.exists() and [(Path(lo.path).name, why) for lo, why in report.kept] == [
            (held.name, "its owner is alive")
        ], report
        assert foreign.read_text() == "a user's notes, only named like a probe"
    finally:
        live.kill()
        live.wait(timeout=_TIMEOUT_S)


def test_a_dry_run_names_a_dead_clock_probe_and_leaves_it(tmp_path: Path) -> None:
    dead, left = _probe_of(tmp_path, killed=True)
    dead.wait(timeout=_TIMEOUT_S)
    report = collect_garbage(tmp_path, dry_run=True)
    assert [Path(lo.path).name for lo in report.removed] == [left.name] and left.exists(), report


@pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")
def test_gc_removes_an_object_stores_clock_probe_whose_process_is_gone(s3_server: S3Server) -> None:
    """Failed before: the empty `.clock-probe-` object a killed process left under the run stayed after gc."""
    config = s3_server.config()
    storage = config.create_storage()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    name = f".clock-probe-{int(gone.stdout)}-{new_nonce()}-{host_tag()}"  # as its killed maker left it
    storage.write(Path("run") / name, b"")
    storage.write(Path("run/notes.txt"), b"a user's file")
    report = collect_garbage(f"{config.url}/run", storage)
    assert [Path(lo.path).name for lo in report.removed] == [name], report
    assert sorted(storage.ls(Path("run"))) == ["notes.txt"]


@pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")
def test_gc_removes_another_hosts_clock_probe_once_it_is_old(s3_server: S3Server) -> None:
    """Another host's probe: its pid names nothing here, so it goes by its age, on the store's clock."""
    config = s3_server.config()
    storage = config.create_storage()
    other = "0badc0de" if host_tag() != "0badc0de" else "0badc0df"
    name = f".clock-probe-4242-{new_nonce()}-{other}"
    storage.write(Path("run") / name, b"")
    young = collect_garbage(f"{config.url}/run", storage, unowned_after_s=3600)
    assert [Path(lo.path).name for lo, _ in young.kept] == [name] and not young.removed, young
    old = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    assert [Path(lo.path).name for lo in old.removed] == [name], old
    assert not storage.exists(Path("run") / name)
