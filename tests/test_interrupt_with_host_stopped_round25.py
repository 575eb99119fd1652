"""Ctrl-C on a rank waiting in an agreement step whose host (rank 0's store) is stopped.

Since round 25 a rank that leaves a step on Ctrl-C first decides, on rank 0's store, that the step failed, so
that the other ranks raise at once. That call must not hold the Ctrl-C: with rank 0 stopped (SIGSTOP, a hung
host) nothing answers it, and the rank sat out the save's whole timeout before the KeyboardInterrupt went on.
The decision is still made once the host answers again, for as long as the rank's process lives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tests.memory_storage import free_port
from tests.probes import stop

ROOT = Path(__file__).resolve().parent.parent

_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=120))
print("up", flush=True)
time.sleep(300)
"""

_RANK_1 = """
import os, signal, sys, threading, time
from torch_checkpointing.agreement import Contribution, StoreTransport
from torch_checkpointing.store_channel import StoreAddress, StoreChannel
channel = StoreChannel(StoreAddress("127.0.0.1", int(sys.argv[1]), "ck"), timeout_s=float(sys.argv[2]))
transport = StoreTransport(rank=1, world_size=2, channel=channel)
print("connected", flush=True)
sys.stdin.readline()  # the host is stopped now
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the rank waits
start = time.monotonic()
try:
    transport.exchange("commit", Contribution(value=1))
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.1f}", flush=True)
sys.stdin.readline()  # the process lives on a while (the host is back): the decision reaches it late
os._exit(0)
"""


def _run(code: str, *argv: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _decided(port: int) -> str | None:
    """What the other ranks read as the step's outcome, once rank 0's store is back."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if client.check(["ck/commit/decided"]):
            return str(client.get("ck/commit/decided").decode())
        time.sleep(0.2)
    return None


def test_ctrl_c_on_a_rank_whose_host_is_stopped_is_not_held_for_the_save_timeout() -> None:
    port = free_port()
    host = _run(_HOST, str(port))
    rank = None
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "up"
        timeout_s = 60
        rank = _run(_RANK_1, str(port), str(timeout_s))
        assert rank.stdout is not None and rank.stdin is not None
        assert rank.stdout.readline().strip() == "connected", rank.stderr.read() if rank.stderr else ""
        stop(host.pid)
        rank.stdin.write("go\n")
        rank.stdin.flush()
        started = time.monotonic()
        line = rank.stdout.readline()
        took = time.monotonic() - started
        assert "interrupted after" in line, f"stdout: {line!r}"
        assert took < 20, f"the Ctrl-C took {took:.0f}s to end the rank's wait (save timeout {timeout_s}s): {line!r}"
        host.send_signal(signal.SIGCONT)
        assert _decided(port) is not None, "the host, back, never heard that rank 1 left the step"
        rank.communicate("done\n", timeout=60)
    finally:
        host.send_signal(signal.SIGCONT)
        host.kill()
        host.wait(timeout=30)
        if rank is not None and rank.poll() is None:
            rank.kill()
            rank.wait(timeout=30)
