"""The autouse check of tests/process_state.py: a test that leaves process-wide state changed fails at its
teardown, naming what it changed, and the tests after it run in the state from before it.

Before it, a test that left a signal handler, an environment variable or a process group behind made a later
test in the same pytest worker fail or pass by the order the worker ran them in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LEAKY = """
import logging, os, resource, signal, threading
import torch.distributed as dist

def test_env(): os.environ["ISO_LEAK"] = "1"
def test_signal(): signal.signal(signal.SIGUSR2, lambda *a: None)
def test_logger(): logging.getLogger("torch_checkpointing").setLevel(logging.DEBUG)
def test_rlimit(): resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
def test_cwd(tmp_path): os.chdir(tmp_path)
def test_umask(): os.umask(0o077)
def test_alarm(): signal.alarm(600)
def test_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1)
stop = threading.Event()
def test_thread(): threading.Thread(target=stop.wait, name="left-running").start()

def test_monkeypatched_is_fine(monkeypatch, tmp_path):
    monkeypatch.setenv("ISO_LEAK", "2")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(signal, "SIGUSR2", signal.SIGUSR2)
def test_after_all_of_them():
    stop.set()
    assert "ISO_LEAK" not in os.environ
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    assert logging.getLogger("torch_checkpointing").level == logging.NOTSET
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert not dist.is_initialized()
"""

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.process_state", "-q", "-rE"]

NAMED = {
    "test_env": "environment variables ['ISO_LEAK']",
    "test_signal": "the handler of SIGUSR2",
    "test_logger": "the 'torch_checkpointing' logger's level",
    "test_rlimit": "RLIMIT_FSIZE",
    "test_cwd": "the working directory",
    "test_umask": "the umask",
    "test_alarm": "a pending alarm",
    "test_group": "process group left initialised",
    "test_thread": "non-daemon threads still running ['left-running']",
}


def test_each_leak_fails_its_own_test_and_is_put_back(tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [*PYTEST, "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout
    blocks = out.split("ERROR at teardown of ")
    said = {block.split(" ", 1)[0]: block for block in blocks[1:]}
    assert sorted(said) == sorted(NAMED), out[-4000:]
    for test, change in NAMED.items():
        assert change in said[test], (test, said[test][-1500:])
    assert "11 passed, 9 errors" in out, out[-4000:]  # the monkeypatched test and the one after all pass
