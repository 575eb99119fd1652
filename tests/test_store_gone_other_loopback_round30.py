"""Rank 0's store on loopback is told gone when what listens on its port is bound to another loopback address.

Round 29 made a loopback host count as there only by a socket that takes loopback connections, and took any
loopback address for one: a socket bound to 127.0.0.2, or to ::1 alone, takes no connection to 127.0.0.1, yet
made the host 127.0.0.1 count as there, and the client retried its refused connect for the save's whole
timeout, as round 29's test shows for a non-loopback address. The sockets here are real; the connect that the
assertion compares with is a real client's.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from torch_checkpointing.store_channel import _refuses_connections


def _listener(family: socket.AddressFamily, address: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address, 0))
    except OSError as exc:
        sock.close()
        pytest.skip(f"cannot listen on {address} here: {exc}")
    sock.listen()
    return sock


@pytest.fixture(params=[(socket.AF_INET, "127.0.0.2"), (socket.AF_INET6, "::1")], ids=["127.0.0.2", "::1-only"])
def elsewhere_on_loopback(request: pytest.FixtureRequest) -> Iterator[int]:
    with _listener(*request.param) as sock:
        yield sock.getsockname()[1]


def test_a_listener_on_another_loopback_address_does_not_keep_the_host_alive(elsewhere_on_loopback: int) -> None:
    """Defect: `_refuses_connections(("127.0.0.1", port))` was False (counted as there) for both."""
    port = elsewhere_on_loopback
    with pytest.raises(ConnectionRefusedError):  # what a client's connect meets: nothing there for it
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    assert _refuses_connections(("127.0.0.1", port), 10.0)


@pytest.mark.parametrize(
    ("family", "bound", "host"),
    [
        (socket.AF_INET, "127.0.0.2", "127.0.0.2"),
        (socket.AF_INET6, "::1", "::1"),
        (socket.AF_INET6, "::1", "localhost"),
        (socket.AF_INET, "127.0.0.1", "localhost"),
        (socket.AF_INET6, "::", "::1"),
    ],
)
def test_a_listener_the_host_reaches_keeps_it_alive(family: socket.AddressFamily, bound: str, host: str) -> None:
    with _listener(family, bound) as sock:
        port = sock.getsockname()[1]
        assert not _refuses_connections((host, port), 10.0)
