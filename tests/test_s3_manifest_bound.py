"""A crafted, oversized manifest.json on S3 is refused on its HEAD, unread, by every reader of it.

No record vouches for the manifest's own size. A load, `latest_checkpoint` and a save checking its id each read
it whole, downloading the object before any size check (now `manifest.read_stored_bounded` sizes it first):
a 300 MiB manifest took 29 s and 310 MiB of memory before it was refused. The bound is lowered here so that a
12 MiB object stands for one over it; the requests are counted at a loopback proxy in front of a real S3 server (moto).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.s3_faults import FaultProxy
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing import latest_checkpoint
from torch_checkpointing.errors import CheckpointError, CorruptCheckpointError
from torch_checkpointing.manifest import MANIFEST_FILE_NAME

BOUND = 1 << 20
HUGE = 12 << 20


@pytest.fixture
def small_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch_checkpointing.manifest.MAX_MANIFEST_BYTES", BOUND)


def test_an_oversized_manifest_is_refused_without_downloading_it(s3_server: S3Server, small_bound: None) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    storage.write(Path("run/huge/model_0.pt"), b"x")
    storage.write(Path("run/huge") / MANIFEST_FILE_NAME, b" " * HUGE)
    port = s3_server.port
    with FaultProxy(port) as proxy:
        through = through_proxy(config, proxy)
        with sync_manager(through) as manager:
            with pytest.raises(CorruptCheckpointError, match=r"run/huge/manifest\.json"):
                manager.load("run/huge")
            with pytest.raises(CheckpointError, match=r"run/huge"):  # the save's check of its id reads it too
                manager.save("run/huge", state(1.0))
        assert latest_checkpoint(f"{config.url}/run", through.create_storage()) is None
        downloads = [line for line in proxy.seen if line.startswith("GET ") and "/run/huge/manifest.json" in line]
    assert downloads == [], downloads
