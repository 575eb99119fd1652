"""A /proc that lists no sockets never makes a live store host on loopback read as gone.

A save's shared channel to rank 0's store on this machine's loopback reads /proc/net/tcp{,6} to tell whether
the store still listens (no connection made). Some sandboxes give a /proc of their own whose socket tables are
there but list nothing (the process's sockets live elsewhere). Before, such a table read as "nothing listens":
every new channel to a live store raised "lost contact with rank 0" at once, and no multi-rank save could
start. The /proc here is a tmpfs of a private mount namespace (root and `unshare` needed), the store a real
TCPStore in the same process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.probes import REPO

_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\\n"

_CHANNEL = """
import datetime, sys
import torch.distributed as dist
from torch_checkpointing.store_channel import StoreAddress, StoreChannel
print(open("/proc/net/tcp").read().count(chr(10)), "line(s) in /proc/net/tcp", flush=True)
host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
channel = StoreChannel(StoreAddress("127.0.0.1", host.port, "ns"), 60.0)
print("CONNECTED", flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/net/tcp is Linux's")
def test_a_proc_without_sockets_does_not_make_a_live_store_read_as_gone() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private mount namespace")
    fake_proc = (
        f"mount -t tmpfs none /proc && mkdir /proc/net && printf '{_HEADER}' > /proc/net/tcp && "
        f'printf \'{_HEADER}\' > /proc/net/tcp6 && exec "$0" -c "$1"'
    )
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", fake_proc, sys.executable, _CHANNEL],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = f"{done.stdout}\n{done.stderr}"
    if "1 line(s) in /proc/net/tcp" not in out:
        pytest.skip(f"no private /proc could be made here: {out[-2000:]}")
    assert done.returncode == 0, out[-3000:]
    assert "CONNECTED" in out, out[-3000:]
