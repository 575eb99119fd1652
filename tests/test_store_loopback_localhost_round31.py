"""A store host named "localhost" counts as there only where a listener takes a connection to what it resolves to.

Round 30 took "localhost" to be 127.0.0.1 and ::1 both. Where it resolves to one of them alone (an /etc/hosts
with no `::1 localhost` line, common in containers), a socket listening on the other alone refused every client's
connect to "localhost", yet made the host count as there (`store_channel._refuses_connections`), and the client
retried its refused connect for the save's whole timeout. The sockets here are real, and so is the connect each
answer is compared with.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from torch_checkpointing.store_channel import _refuses_connections


def _refused_by_a_client(host: str, port: int) -> bool:
    """Whether a client's connect to (host, port), trying every address `host` resolves to, is refused."""
    try:
        socket.create_connection((host, port), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture(
    params=[(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1"), (socket.AF_INET, "0.0.0.0")],
    ids=["127.0.0.1-only", "::1-only", "ipv4-wildcard"],
)
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    """The port of a socket listening on one loopback address (or IPv4's wildcard) alone."""
    family, address = request.param
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address, 0))
    except OSError as exc:
        pytest.skip(f"cannot listen on {address} here: {exc}")
    with sock:
        sock.listen()
        yield sock.getsockname()[1]


def test_localhost_counts_as_there_where_a_client_reaches_it(port: int) -> None:
    """Defect (where "localhost" is 127.0.0.1 alone, as in this project's CI container): with a listener on ::1
    alone, `_refuses_connections(("localhost", port))` was False while a client's connect was refused."""
    assert _refuses_connections(("localhost", port), 10.0) == _refused_by_a_client("localhost", port)
