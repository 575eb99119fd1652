"""Object-store leftovers of round 32, against the real moto server (tests/s3_server.py)."""

from __future__ import annotations

import logging
import mmap
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_faults import FaultProxy
from tests.s3_server import S3Server
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
    SerializationFormat,
    TorchSerialization,
)
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import latest_checkpoint, list_checkpoints
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.manifest import MANIFEST_FILE_NAME
from torch_checkpointing.storage import fsspec_storage
from torch_checkpointing.storage.fsspec_storage import MAX_PARTS, MIN_PART_SIZE, FsspecStorage, FsspecStorageConfig

s3fs = pytest.importorskip("s3fs")  # the optional S3 extra: every test here needs the server

_FAST_FAIL = {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 1, "mode": "standard"}}


def _through(config: FsspecStorageConfig, proxy: FaultProxy) -> FsspecStorageConfig:
    options = {**config.storage_options, "config_kwargs": _FAST_FAIL, "endpoint_url": proxy.endpoint}
    return FsspecStorageConfig(url=config.url, part_size=config.part_size, storage_options=options)


def test_repeated_requests_reuse_one_wrapper_per_method(s3_server: S3Server) -> None:
    """Every S3 request looked its method up on the filesystem that names a missing bucket, and each lookup
    built a new wrapper (a closure and its `functools.wraps` copy): work per request for the same answer."""
    storage = s3_server.config().create_storage()
    io = storage._backend("s3").io
    seen = [io.call_s3 for _ in range(100)] + [io.call_s3 for _ in range(100)]
    assert len({id(call) for call in seen}) == 1
    assert storage.exists(Path("run/absent")) is False  # the wrapper still works
    copied = pickle.loads(pickle.dumps(io))  # the kept wrappers are no state of a copy
    assert copied.call_s3 is copied.call_s3 and copied.call_s3 is not io.call_s3


def test_an_object_needing_more_than_10000_parts_is_refused_once_not_also_logged(
    s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal, made before any request, reaches the caller: it was logged as a WARNING as well, the one
    failure told twice."""
    storage = s3_server.config(part_size=MIN_PART_SIZE).create_storage()
    size = MIN_PART_SIZE * MAX_PARTS + 1
    sparse = tmp_path / "huge.bin"
    with open(sparse, "wb") as out:  # sparse: no disk, and its pages are never read
        out.truncate(size)
    caplog.set_level(logging.DEBUG, logger="torch_checkpointing")
    with open(sparse, "rb") as raw:
        data = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ)  # closed when unreferenced
        with pytest.raises(ObjectStoreError, match="10000 parts") as caught:
            storage.write(Path("run/step_1/model_0.pt"), data)
    assert str(caught.value) not in caplog.text, caplog.text


def test_a_stream_past_the_part_limit_says_what_was_sent_and_leaves_no_upload(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream of unknown length that needs more parts than S3 takes (the limit lowered to 3 here, 10,000 on
    S3: 50 GiB at 5 MiB). Before, its error said only "more than 10000 parts", not how much had been sent nor
    whether the upload was aborted; now it says both, and the store keeps no unfinished upload of it."""
    monkeypatch.setattr(fsspec_storage, "MAX_PARTS", 3)
    config = s3_server.config(part_size=MIN_PART_SIZE)
    bucket = config.url.removeprefix("s3://")
    storage = config.create_storage()
    part = bytes(MIN_PART_SIZE)
    with pytest.raises(ObjectStoreError) as caught, storage.stream_write(Path("run/step_1/model_0.pt")) as stream:
        for _ in range(5):
            stream.write(part)
    said = str(caught.value)
    assert "run/step_1/model_0.pt" in said and "3 parts" in said, said
    assert f"{3 * MIN_PART_SIZE} bytes had been sent" in said and "aborted" in said, said
    left = storage.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert left == [], left
    assert not storage.exists(Path("run/step_1/model_0.pt"))


@pytest.mark.parametrize("fmt", [RawSerialization(), SafetensorsSerialization(), TorchSerialization()])
def test_a_save_whose_item_is_known_too_large_sends_none_of_it(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, fmt: SerializationFormat
) -> None:
    """An item whose size is known up front (bytes, a tensor: written in one piece) that needs more parts than
    S3 takes (the limit lowered to 3 here, 10,000 on S3). Before, its parts were uploaded up to the limit
    (10,000 of them, 50 GiB at 5 MiB) before the save failed; now none is, and the error names the size."""
    monkeypatch.setattr(fsspec_storage, "MAX_PARTS", 3)
    config = s3_server.config(part_size=MIN_PART_SIZE)
    size = 3 * MIN_PART_SIZE + 1
    value: object = bytes(size) if isinstance(fmt, RawSerialization) else torch.zeros(size, dtype=torch.uint8)
    manager = CheckpointManager(
        CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(),
            storage_config=_through(config, proxy := FaultProxy(s3_server.port)),
            items={"blob": ItemSpec(layout=LayoutInfo("blob_{rank}.bin", fmt))},
        )
    )
    with proxy, manager, pytest.raises(ObjectStoreError) as caught:
        manager.save("run/step_1", {"blob": value})
    said = f"{caught.value}"
    assert "0 bytes had been sent" in said and "3 parts" in said, said
    assert not [line for line in proxy.seen if "partNumber=" in line], proxy.seen


class _BucketDeletedAtManifestLookup(s3fs.S3FileSystem):  # type: ignore[misc]
    """Real S3 requests; the first lookup of a manifest first empties and deletes the bucket (a lifecycle rule
    or an operator acting between a listing and the lookups that follow it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dropped = False

    def _drop_bucket_at_manifest(self, path: str) -> None:
        if self.dropped or not path.endswith(MANIFEST_FILE_NAME):
            return
        self.dropped = True
        bucket = self.split_path(path)[0]
        for key in self.find(bucket):
            self.rm_file(key)
        self.call_s3("delete_bucket", Bucket=bucket)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self._drop_bucket_at_manifest(path)
        return bool(super().exists(path, **kwargs))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._drop_bucket_at_manifest(path)
        return dict(super().info(path, **kwargs))


@pytest.mark.parametrize("lookup", [list_checkpoints, latest_checkpoint])
def test_a_bucket_deleted_between_the_listing_and_the_manifest_lookup_is_named(
    s3_server: S3Server, lookup: Callable[[str, FsspecStorage], object]
) -> None:
    """`list_checkpoints` (the CLI's `list`, retention) lists the run (the bucket answers), then asks `exists` of
    each manifest. Before, that lookup answered False in a bucket deleted meanwhile (s3fs swallows its
    NoSuchBucket): every checkpoint was skipped and the run listed empty, `[]`. Now the lookup names the bucket."""
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    storage = config.create_storage()
    storage.write(Path("run/step_1") / MANIFEST_FILE_NAME, b"{}")
    fs = _BucketDeletedAtManifestLookup(**s3_server.storage_options())
    racing = FsspecStorageConfig(url=config.url, part_size=config.part_size, filesystem=fs).create_storage()
    with pytest.raises(ObjectStoreError, match=rf"the bucket '{bucket}' does not exist") as caught:
        found = lookup(f"{config.url}/run", racing)
        pytest.fail(f"{lookup.__name__} answered {found!r} in a bucket deleted under it")
    assert f"s3://{bucket}/run/step_1/{MANIFEST_FILE_NAME}" in str(caught.value)
    assert fs.dropped


def test_a_save_to_a_bucket_never_seen_still_fails_at_its_upload(s3_server: S3Server) -> None:
    """The other side: `exists` in a bucket this storage never saw stays False (a save's first check); the
    upload that follows names the bucket."""
    storage = s3_server.config(bucket="never-made-r33").create_storage()
    assert storage.exists(Path("run/step_1")) is False
    with pytest.raises(ObjectStoreError, match="never-made-r33.*NoSuchBucket"):
        storage.write(Path("run/step_1/a.json"), b"{}")


def test_a_stream_closed_after_a_failed_write_stores_nothing(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoder that catches a failed write and closes the stream anyway (close() rather than leaving its
    `with` on the error). Before, close() committed what was there: the parts sent before the part limit was
    met (a truncated file), or, once that write aborted the upload, its empty buffer as the object."""
    monkeypatch.setattr(fsspec_storage, "MAX_PARTS", 3)
    config = s3_server.config(part_size=MIN_PART_SIZE)
    storage = config.create_storage()
    path = Path("run/step_1/model_0.pt")
    stream = storage.stream_write(path)
    with pytest.raises(ObjectStoreError) as failed:
        for _ in range(5):
            stream.write(bytes(MIN_PART_SIZE))
    with pytest.raises(ObjectStoreError) as closing:
        stream.close()
    assert closing.value is failed.value
    assert not storage.exists(path)
    left = storage.fs.call_s3("list_multipart_uploads", Bucket=config.url.removeprefix("s3://")).get("Uploads", [])
    assert left == [], left
