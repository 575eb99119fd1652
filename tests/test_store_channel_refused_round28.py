"""A new channel to rank 0's store once rank 0 is gone (round 28; CI saw it as a 6 s wait in
`test_store_host_gone_async_round24_multirank[killed]`).

A rank whose process holds no client of rank 0's store yet (a trainer answering for its writer, a writer
started after the last save) connected anew, and a TCPStore client's connect retries a refused connection for
its whole timeout: with rank 0 killed, that rank raised "lost contact with rank 0" one `wait_timeout_secs`
after the others. The store's address is only ever learnt from rank 0 once its store listens, so a refused
connection to it means it is gone: the channel says so at once. A barrier's peer, which may connect before its
host listens, still waits (its client is its own, `shared=False`).
"""

from __future__ import annotations

import subprocess
import sys

LONG_TIMEOUT_S = 600  # the channel's; the process is bounded by a tenth of it

CHANNEL = """
import socket, sys
from torch_checkpointing.errors import CommitError
from torch_checkpointing.store_channel import StoreAddress, StoreChannel
with socket.socket() as s:  # a port nothing listens on: rank 0's store, gone with its process
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
try:
    StoreChannel(StoreAddress("127.0.0.1", port, "ns"), float(sys.argv[1]))
except CommitError as exc:
    print(type(exc).__name__, exc.failures)
"""


def test_a_new_channel_to_a_store_that_refuses_connections_raises_lost_contact_without_waiting() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHANNEL, str(LONG_TIMEOUT_S)],
        capture_output=True,
        text=True,
        timeout=LONG_TIMEOUT_S / 10,  # before: the connect retried for the whole 600 s
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split(" ", 1) == ["CommitError", "{0: 'went away (its checkpoint store is unreachable)'}\n"]
    assert "Lost contact with rank 0's checkpoint store: ConnectionRefusedError" in done.stderr, done.stderr


# A host that dies as a channel's client connects: it listens (the channel's first check passes), accepts the
# client's connection, then exits (rank 0 SIGKILLed at that moment), so the client's validation is reset and its
# retries are refused.
DIES_AS_ONE_CONNECTS = """
import os, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    s.accept()
    os._exit(0)
"""

CHANNEL_TO = """
import sys
from torch_checkpointing.errors import CommitError
from torch_checkpointing.store_channel import StoreAddress, StoreChannel
try:
    StoreChannel(StoreAddress("127.0.0.1", int(sys.argv[1]), "ns"), float(sys.argv[2]))
except CommitError as exc:
    print(type(exc).__name__, exc.failures)
"""


def test_a_host_that_dies_while_a_channel_connects_is_lost_contact_without_waiting_out_the_retries() -> None:
    """Failed before (CI, `test_store_host_gone_async_round24_multirank[killed]`, one rank 10 s then 23 s late): the
    client's connect retried the reset, then refused, connection for its timeout, more than once."""
    host = subprocess.Popen([sys.executable, "-c", DIES_AS_ONE_CONNECTS], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = host.stdout.readline().strip()
        done = subprocess.run(
            [sys.executable, "-c", CHANNEL_TO, port, str(LONG_TIMEOUT_S)],
            capture_output=True,
            text=True,
            timeout=LONG_TIMEOUT_S / 10,  # before: the connect's retries ran for twice the 600 s
        )
    finally:
        host.kill()
        host.wait(timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split(" ", 1) == ["CommitError", "{0: 'went away (its checkpoint store is unreachable)'}\n"]
