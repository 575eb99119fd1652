"""The check that rank 0's store is gone, made as a new channel connects, waits no longer than the check its
connect makes every half second (round 29).

The check is a plain connect: a refusal comes at once, and only a refusal says the host is gone. It was given
the channel's whole timeout: to a host that drops connects (its listen backlog full of thousands of ranks'
connects) it waited that timeout, and the client's own connect waited it again, doubling the wait of every
rank's first save. Here the host is a real listener whose backlog is full, reached by a name that is not
loopback's (so the check connects), and the waits the check allowed are read off the real connects it made.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from torch_checkpointing import store_channel
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.store_channel import StoreAddress, StoreChannel

CHANNEL_TIMEOUT_S = 3.0
_MAPPED_LOOPBACK = "::ffff:127.0.0.1"  # loopback, by a name the channel does not read as loopback


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A port whose listener accepts nothing and whose backlog is full: a connect's SYN is dropped."""
    listener = socket.socket(socket.AF_INET6)
    listener.bind(("::", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    for _ in range(4):
        filler = socket.socket(socket.AF_INET6)
        filler.setblocking(False)
        filler.connect_ex((_MAPPED_LOOPBACK, port))
        fillers.append(filler)
    try:
        yield port
    finally:
        for sock in [*fillers, listener]:
            sock.close()


def test_the_gone_check_of_a_new_channel_waits_no_longer_than_its_periodic_one(
    full_backlog: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = store_channel._probe
    waits: list[float] = []

    def recorded(host: tuple[str, int], timeout_s: float) -> OSError | None:
        waits.append(timeout_s)
        return probe(host, timeout_s)

    monkeypatch.setattr(store_channel, "_probe", recorded)
    with pytest.raises(CheckpointError):
        StoreChannel(StoreAddress(_MAPPED_LOOPBACK, full_backlog, "ns"), CHANNEL_TIMEOUT_S)
    assert waits, "no check connected: the name was read as loopback"
    # Before: the first check waited the channel's whole timeout (3.0) before the client's connect began.
    assert max(waits) < CHANNEL_TIMEOUT_S, waits
    assert max(waits) <= store_channel._GONE_CHECK_WAIT_S, waits
