"""Rank 0's store on this machine's loopback is told gone only by what listens there, not on another address.

A save's channel to a store on loopback looks at this machine's listening sockets instead of connecting
(`store_channel._refuses_connections`). Before, any socket listening on the port counted, whatever its address:
one bound to a non-loopback address of this machine (another program that took the port once rank 0 was gone)
accepts no connection to 127.0.0.1, yet made the host count as there, and the client retried its refused
connect for the save's whole timeout. Round 30: round 29 took any loopback address for one that takes loopback
connections, and a socket bound to 127.0.0.2, or to ::1 alone, made the host 127.0.0.1 count as there too. The
sockets here are real; the connect each assertion is compared with is a real client's.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from torch_checkpointing.store_channel import _refuses_connections


def _own_address() -> str | None:
    """One of this machine's non-loopback IPv4 addresses (from its routing, no packet sent), if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: UDP connect only picks the source address
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def _listener(family: socket.AddressFamily, address: str | None, v6only: bool = True) -> socket.socket:
    """A socket listening on `address`, a free port; the test is skipped where this machine cannot have one."""
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        pytest.skip(f"no such socket here: {exc}")
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.bind((address, 0))
    except OSError as exc:
        sock.close()
        pytest.skip(f"cannot listen on {address} here: {exc}")
    sock.listen()
    return sock


@pytest.fixture(
    params=[
        (socket.AF_INET, "own address", False),
        (socket.AF_INET, "127.0.0.2", False),
        (socket.AF_INET6, "::1", True),
    ],
    ids=["non-loopback", "127.0.0.2", "::1-only"],
)
def listener_elsewhere(request: pytest.FixtureRequest) -> Iterator[tuple[int, bool]]:
    """The port of a socket that takes no connection to 127.0.0.1, and whether "localhost" cannot reach it."""
    family, address, v6 = request.param
    with _listener(family, _own_address() if address == "own address" else address) as sock:
        yield sock.getsockname()[1], not v6  # "localhost" is ::1 too


def test_a_listener_on_another_address_does_not_keep_a_loopback_host_alive(
    listener_elsewhere: tuple[int, bool],
) -> None:
    """Defect (round 30's cases): `_refuses_connections(("127.0.0.1", port))` was False (counted as there)."""
    port, localhost_refused = listener_elsewhere
    with pytest.raises(ConnectionRefusedError):  # what a client's connect meets: nothing there for it
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    assert _refuses_connections(("127.0.0.1", port), 10.0)
    if localhost_refused:
        assert _refuses_connections(("localhost", port), 10.0)


@pytest.mark.parametrize(
    ("family", "bound", "hosts", "v6only"),
    [
        (socket.AF_INET, "0.0.0.0", ("127.0.0.1", "localhost"), True),
        (socket.AF_INET, "127.0.0.1", ("127.0.0.1", "localhost"), True),
        (socket.AF_INET6, "::", ("127.0.0.1", "::1"), False),  # dual stack
        (socket.AF_INET, "127.0.0.2", ("127.0.0.2",), True),
        (socket.AF_INET6, "::1", ("::1",), True),  # "localhost": test_store_loopback_localhost_round31
        (socket.AF_INET6, "::", ("::1",), True),
    ],
)
def test_a_listener_the_host_reaches_keeps_it_alive(
    family: socket.AddressFamily, bound: str, hosts: tuple[str, ...], v6only: bool
) -> None:
    with _listener(family, bound, v6only) as sock:
        port = sock.getsockname()[1]
        for host in hosts:
            assert not _refuses_connections((host, port), 10.0), host
