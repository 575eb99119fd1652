"""A listing on S3 looks at several checkpoints at once.

Each checkpoint costs a listing's look a few requests (is it a directory, is its manifest there, the manifest
itself), and they were made one after another: 1105 checkpoints took 46 s to list on the test server, and
`latest_checkpoint` (every resume) and retention (every save) list. The store here is the real test server
behind a proxy that holds each manifest GET a while, as a store's round trip does, and counts how many are in
flight together. The timing itself is measured apart (a side script), not asserted here.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server, missing_s3_packages
from torch_checkpointing import CheckpointManager, latest_checkpoint, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")

_STEPS = 6
_HOLD_S = 0.3


class _RoundTripProxy(FaultProxy):
    """Holds each manifest GET `_HOLD_S` before passing it on, counting the most in flight at once."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.in_flight = 0
        self.most_in_flight = 0
        self._count = threading.Lock()

    def _answer(self, client: socket.socket, head: bytes, request_line: str) -> bool:
        if not (request_line.startswith("GET ") and "/manifest.json" in request_line):
            return super()._answer(client, head, request_line)
        with self._count:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(_HOLD_S)
        with self._count:
            self.in_flight -= 1
        return super()._answer(client, head, request_line)


def _saved_run(s3_server: S3Server) -> FsspecStorageConfig:
    config = s3_server.config()
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
        for step in range(1, _STEPS + 1):
            m.save(f"run/step_{step}", {"model": {"w": torch.full((4,), float(step))}})
    return config


def _through(config: FsspecStorageConfig, proxy: FaultProxy) -> Any:
    options = {
        **config.storage_options,
        "endpoint_url": proxy.endpoint,
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    return FsspecStorageConfig(url=config.url, storage_options=options).create_storage()


def test_a_listing_on_s3_reads_several_manifests_at_once_and_keeps_its_order(s3_server: S3Server) -> None:
    """Defect: the manifests were read one at a time (most in flight: 1), a round trip each."""
    config = _saved_run(s3_server)
    with _RoundTripProxy(s3_server.port) as proxy:
        storage = _through(config, proxy)
        listed = list_checkpoints(f"{config.url}/run", storage)
        assert [info.step for info in listed] == list(range(1, _STEPS + 1))
        assert [info.path for info in listed] == [f"{config.url}/run/step_{s}" for s in range(1, _STEPS + 1)]
        assert proxy.most_in_flight > 1, "one manifest read at a time"
        newest = latest_checkpoint(f"{config.url}/run", storage)
        assert newest is not None and newest.step == _STEPS


def test_a_manifest_the_store_fails_to_serve_fails_the_concurrent_listing_naming_it(s3_server: S3Server) -> None:
    """A store that fails one read among many still fails the listing (never a shorter listing, where "latest"
    goes back a step), naming the checkpoint, as the one-at-a-time listing did."""
    config = _saved_run(s3_server)
    with FaultProxy(s3_server.port) as proxy:
        proxy.rules = [Rule(r"^GET \S*/run/step_4/manifest\.json", 503, "ServiceUnavailable")]
        storage = _through(config, proxy)
        with pytest.raises(ObjectStoreError, match=r"run/step_4"):
            list_checkpoints(f"{config.url}/run", storage)
        with pytest.raises(ObjectStoreError, match=r"run/step_4"):
            latest_checkpoint(f"{config.url}/run", storage)
