"""Object-store leftovers of round 32, against the real moto server (tests/s3_server.py)."""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from typing import Any

import pytest

from tests.s3_faults import LOST, FaultProxy, Rule
from tests.s3_server import S3Server
from torch_checkpointing.errors import ConfigError, ObjectStoreError
from torch_checkpointing.storage.fsspec_storage import MAX_PARTS, MIN_PART_SIZE, FsspecStorageConfig, MiB

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


GiB = 1 << 30


@pytest.mark.parametrize("where", [{"url": "s3://bucket/run"}, {"protocol": "s3a"}, {}])
def test_a_part_size_past_s3s_largest_part_is_refused_naming_it(where: dict[str, str]) -> None:
    """S3 takes parts of 5 MiB to 5 GiB. Before, `part_size=5 GiB + 1` was taken, and every file larger than
    5 GiB failed at its upload (EntityTooLarge), after the save had staged and encoded everything."""
    with pytest.raises(ConfigError, match=r"FsspecStorageConfig\.part_size .*5368709120") as caught:
        FsspecStorageConfig(part_size=5 * GiB + 1, **where)
    assert "5 MiB to 5 GiB" in str(caught.value)
    assert FsspecStorageConfig(part_size=5 * GiB, **where).part_size == 5 * GiB


def test_a_part_size_past_5_gib_stays_allowed_on_a_store_without_that_rule() -> None:
    assert FsspecStorageConfig(url="memory://run", part_size=6 * GiB).part_size == 6 * GiB


def test_a_part_size_under_5_mib_is_refused_naming_the_argument() -> None:
    with pytest.raises(ConfigError, match=r"FsspecStorageConfig\.part_size .*5242880"):
        FsspecStorageConfig(url="s3://bucket/run", part_size=5 * MiB - 1)


def test_an_object_needing_more_than_10000_parts_is_refused_before_its_upload(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A file of more than `part_size` x 10,000 bytes cannot be one S3 object at that part size. Before, its
    upload began, and failed after 10,000 parts had been sent (50 GiB at 5 MiB) with no word of the size it
    needed; now it is refused before any request, naming the object, its size and the part_size it needs."""
    config = s3_server.config(part_size=MIN_PART_SIZE)
    size = MIN_PART_SIZE * MAX_PARTS + 1
    sparse = tmp_path / "huge.bin"
    with open(sparse, "wb") as out:  # sparse: no disk, and its pages are read only if an upload reads them
        out.truncate(size)
    with FaultProxy(s3_server.port) as proxy, open(sparse, "rb") as raw:
        proxy.rules = [Rule(r"^(PUT|POST) ", 500, "InternalError")]  # the old code's first upload request ends it
        storage = _through(config, proxy).create_storage()
        data = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ)  # closed when unreferenced
        with pytest.raises(ObjectStoreError) as caught:
            storage.write(Path("run/step_1/model_0.pt"), data)
        said = str(caught.value)
        assert "run/step_1/model_0.pt" in said and str(size) in said and "10000 parts" in said
        assert f"part_size to at least {MIN_PART_SIZE + 1}" in said
        assert not [line for line in proxy.seen if not line.startswith(("HEAD ", "GET "))]  # nothing uploaded


def test_a_bucket_deleted_after_its_first_check_is_named_not_read_as_empty(s3_server: S3Server) -> None:
    """The bucket check asks the store once per storage; a bucket deleted after that (a lifecycle job, an
    operator) made every later listing and read a bare "not found", though the store's own answer said
    NoSuchBucket: a resume listed no checkpoint and started from scratch. Now that answer is the error."""
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    storage = config.create_storage()
    with pytest.raises(FileNotFoundError):
        storage.getsize(Path("run/absent.pt"))  # the first miss: the bucket is checked, and there
    storage.fs.call_s3("delete_bucket", Bucket=bucket)
    for what, lookup in (
        ("listing of", lambda: storage.ls(Path("run"))),
        ("download of", lambda: storage.read(Path("run/step_1/model_0.pt"))),
        ("ranged read of", lambda: storage.read_range(Path("run/step_1/model_0.pt"), 0, 4)),
    ):
        with pytest.raises(ObjectStoreError, match=rf"{what} s3://{bucket}/run.* the bucket '{bucket}' does not"):
            lookup()
