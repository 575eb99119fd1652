"""Object-store leftovers of round 32, against the real moto server (tests/s3_server.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.s3_faults import LOST, FaultProxy, Rule
from tests.s3_server import S3Server
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

# One try, short timeouts: a dropped connection fails in seconds, not after the client's backoff.
_FAST_FAIL = {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 1, "mode": "standard"}}


def _through(config: FsspecStorageConfig, proxy: FaultProxy, **extra: Any) -> FsspecStorageConfig:
    options: dict[str, Any] = {**config.storage_options, "config_kwargs": _FAST_FAIL, "endpoint_url": proxy.endpoint}
    return FsspecStorageConfig(url=config.url, part_size=config.part_size, storage_options=options, **extra)


@pytest.mark.parametrize("status", [LOST, 0])
def test_a_failed_bucket_check_leaves_the_lookups_not_found_standing(s3_server: S3Server, status: int) -> None:
    """A key missing from a bucket that exists, whose HEAD of the bucket fails without an S3 code (the
    connection lost; no answer within `request_timeout_s`, whose `FSTimeoutError` has no cause of its own):
    the bucket check must not read the lookup's own 404, the context of that error, as "no such bucket".
    Before, the hung HEAD failed the lookup with "the bucket ... does not exist" for a bucket that exists."""
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    with FaultProxy(s3_server.port) as proxy:
        proxy.rules = [Rule(rf"^HEAD /{bucket} ", status)]
        storage = _through(config, proxy, request_timeout_s=2.0).create_storage()
        with pytest.raises(FileNotFoundError):
            storage.getsize(Path("run/step_1/absent.pt"))
        assert any(line.startswith(f"HEAD /{bucket} ") for line in proxy.seen)  # the bucket was asked about


class _GoneAfter(FaultProxy):
    """A proxy that stops listening once a request matching `last` has come (that one is still served): every
    later request finds its port closed (connection refused), as for a store that went away."""

    last: str = ""

    def _rule_for(self, request_line: str) -> Rule | None:
        if re.search(self.last, request_line):
            self._listener.close()
        return super()._rule_for(request_line)

    def _accept_loop(self) -> None:
        try:
            super()._accept_loop()
        except OSError:  # the listener was closed under accept(): nothing more to accept
            return


def test_a_refused_bucket_check_after_a_missing_object_is_no_missing_bucket(s3_server: S3Server) -> None:
    """A ranged read of a missing object (its GET answers NoSuchKey), then the store cannot be reached for the
    HEAD of the bucket: botocore's `EndpointConnectionError` has no cause, and Python chains it to the read's
    "not found" (the error handled as the check ran), whose cause carries the code NoSuchKey. Before, the check
    read that code as its own answer and said "the bucket ... does not exist" of a bucket that exists."""
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    with _GoneAfter(s3_server.port) as proxy:
        proxy.last = rf"^GET /{bucket}/run/absent\.pt "
        storage = _through(config, proxy).create_storage()
        with pytest.raises(FileNotFoundError):
            storage.read_range(Path("run/absent.pt"), 0, 10)
        assert proxy.seen == [f"GET /{bucket}/run/absent.pt HTTP/1.1"]  # the HEAD of the bucket was refused
