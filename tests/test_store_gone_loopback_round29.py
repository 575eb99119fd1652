"""Rank 0's store on this machine's loopback is told gone only by what listens there, not on another address.

A save's channel to a store on loopback looks at this machine's listening sockets instead of connecting
(`store_channel._refuses_connections`). Before, any socket listening on the port counted, whatever its address:
one bound to a non-loopback address of this machine (another program that took the port once rank 0 was gone)
accepts no connection to 127.0.0.1, yet made the host count as there, and the client retried its refused
connect for the save's whole timeout.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from torch_checkpointing.store_channel import _refuses_connections


def _own_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses (from its routing, no packet sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: UDP connect only picks the source address
            address = probe.getsockname()[0]
    except OSError:
        return []
    return [] if address.startswith("127.") else [address]


@pytest.fixture
def listener_elsewhere() -> Iterator[int]:
    addresses = _own_addresses()
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addresses[0], 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_listener_on_another_address_does_not_keep_a_loopback_host_alive(listener_elsewhere: int) -> None:
    port = listener_elsewhere
    with pytest.raises(ConnectionRefusedError):  # what a client's connect meets: nothing there for it
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    assert _refuses_connections(("127.0.0.1", port), 10.0)
    assert _refuses_connections(("localhost", port), 10.0)


@pytest.mark.parametrize("bound", ["0.0.0.0", "127.0.0.1"])
def test_a_listener_reachable_over_loopback_keeps_the_host_alive(bound: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((bound, 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not _refuses_connections(("127.0.0.1", port), 10.0)
        assert not _refuses_connections(("localhost", port), 10.0)


def test_a_dual_stack_listener_keeps_the_host_alive() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 socket here: {exc}")
    with sock:
        sock.listen()
        port = sock.getsockname()[1]
        assert not _refuses_connections(("127.0.0.1", port), 10.0)
        assert not _refuses_connections(("::1", port), 10.0)
