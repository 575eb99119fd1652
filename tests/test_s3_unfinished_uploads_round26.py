"""Unfinished S3 multipart uploads: parts the store keeps, and bills, until the upload is completed or aborted.

* A CreateMultipartUpload whose answer was lost: the client retried it and the store made a second upload; the
  save completed that one, and the first stayed for ever, though the save succeeded.
* A dead save's prefix that gc collected, or one it removed whole: the uploads its writer had under way when it
  was killed stayed. gc now aborts them, listed while the dead claim is still there (a save that takes the id
  over after has none among them), and never the uploads of a live save's prefix or of another id.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_faults import LOST, FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_objstore_round21 import _dead_pid
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing.commit import Claim
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.names import this_host
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.fsspec_storage import FsspecStorage

s3fs = pytest.importorskip("s3fs")

_BIG = 3_000_000  # float32s: 12 MB, more than two 5 MiB parts, so the file is a multipart upload


def _bucket(storage: FsspecStorage, prefix: str) -> tuple[str, str]:
    bucket, key, _ = storage.fs.split_path(prefix)
    return bucket, key


def _uploads(storage: FsspecStorage, prefix: str) -> list[str]:
    """The keys of the unfinished multipart uploads under `prefix` (`bucket/key...`)."""
    bucket, key = _bucket(storage, prefix)
    found = storage.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", [])
    return sorted(u["Key"] for u in found)


def _start_upload(storage: FsspecStorage, key: str) -> str:
    """An upload under way at `key` (`bucket/key`) with one part sent: what a writer killed mid-file leaves."""
    bucket, name = _bucket(storage, key)
    upload_id = storage.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=name)["UploadId"]
    storage.fs.call_s3("upload_part", Bucket=bucket, Key=name, UploadId=upload_id, PartNumber=1, Body=b"x" * 1024)
    return str(upload_id)


def _claim(pid: int, tags: bool) -> bytes:
    return Claim(".step.tmp-0123456789ab-1", "0123456789ab", this_host(), pid, time.time(), tags=tags).to_bytes()


def test_a_create_whose_answer_is_lost_leaves_no_unfinished_upload(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    run = storage.remap_path(Path("run")).split("://", 1)[1]
    other = f"{run}/step_1/model_0.pt.part"  # another writer's upload, of a key the save's keys are prefixes of
    _start_upload(storage, other)
    port = s3_server.port
    with FaultProxy(port) as proxy:
        proxy.rules = [Rule(r"^POST \S*\?uploads", LOST, times=1)]
        with sync_manager(through_proxy(config, proxy)) as manager:
            manager.save("run/step_1", state(1.0, n=_BIG))
        creates = [line for line in proxy.seen if line.startswith("POST ") and "?uploads" in line]
    assert len(creates) >= 2, creates  # the lost one, done by the store, and the client's retry
    assert _uploads(storage, run) == [other.split("/", 1)[1]]  # only the other writer's is left
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(1.0, n=_BIG)["model"]["w"])


@pytest.mark.parametrize("tags", [True, False], ids=["tagged-claim", "earlier-claim-collected-whole"])
def test_gc_of_a_dead_saves_prefix_aborts_its_unfinished_uploads_and_no_others(s3_server: S3Server, tags: bool) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    run = storage.remap_path(Path("run")).split("://", 1)[1]
    storage.write(Path("run/step_1") / INCOMPLETE_MARKER, _claim(_dead_pid(), tags))  # a killed save
    _start_upload(storage, f"{run}/step_1/model_0.pt")
    storage.write(Path("run/step_12") / INCOMPLETE_MARKER, _claim(os.getpid(), tags))  # a live save beside it
    _start_upload(storage, f"{run}/step_12/model_0.pt")
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=3600)
    assert [lo.path for lo in report.removed] == [f"{config.url}/run/step_1"], report
    assert _uploads(storage, f"{run}/step_1/") == []
    assert _uploads(storage, run) == [f"{run.split('/', 1)[1]}/step_12/model_0.pt"]  # the live save's stays


def test_a_failed_saves_cleanup_aborts_what_its_claim_covers(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A save whose upload fails removes its prefix under its own claim: an upload a writer left there (killed,
    or its abort lost) goes with it."""
    config = s3_server.config()
    storage = config.create_storage()
    run = storage.remap_path(Path("run")).split("://", 1)[1]
    port = s3_server.port
    seen: dict[str, BaseException] = {}
    with FaultProxy(port) as proxy:
        # Every abort is lost, as a writer killed mid-file never sends its own; the save's last file fails.
        proxy.rules = [
            Rule(r"^DELETE \S*uploadId=", 500, until=rf"^DELETE \S*/\{INCOMPLETE_MARKER}"),  # up to the claim's removal
            Rule(r"^POST \S*uploadId=", 500),
        ]
        with (
            caplog.at_level(logging.WARNING, logger="torch_checkpointing"),
            sync_manager(through_proxy(config, proxy)) as manager,
            pytest.raises(ObjectStoreError, match="complete_multipart_upload") as failed,
        ):
            manager.save("run/step_1", state(1.0, n=_BIG))
        seen["error"] = failed.value
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("Could not abort the multipart upload") for m in said), said  # the writer's own
    assert _uploads(storage, run) == [], seen


def test_a_save_that_takes_a_dead_claim_over_aborts_the_dead_saves_uploads(s3_server: S3Server) -> None:
    """The next save of a killed save's id takes its claim over and commits there: nothing removes the prefix
    after that, so the killed writer's upload stayed for good."""
    config = s3_server.config()
    storage = config.create_storage()
    run = storage.remap_path(Path("run")).split("://", 1)[1]
    storage.write(Path("run/step_1") / INCOMPLETE_MARKER, _claim(_dead_pid(), tags=True))
    _start_upload(storage, f"{run}/step_1/model_1.pt")  # the killed save's rank 1 file: this save has no rank 1
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0, n=_BIG))
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(1.0, n=_BIG)["model"]["w"])
    assert _uploads(storage, run) == []


class _ListingWaitsForAPart(s3fs.S3FileSystem):  # type: ignore[misc]
    """Real S3 requests; a ListMultipartUploads answers only once a part of the upload is on its way (or after
    `_WAIT_S`), as a slow listing on a bucket with many uploads answers after the first part has gone."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.part_started = threading.Event()
        self.listing_waited_for_a_part: list[bool] = []

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part":
            self.part_started.set()
        if method == "list_multipart_uploads":
            self.listing_waited_for_a_part.append(self.part_started.wait(_WAIT_S))
        return super().call_s3(method, *args, **kwargs)


_WAIT_S = 5.0


def test_the_lost_create_check_is_off_the_uploads_path(s3_server: S3Server) -> None:
    """Round 26 review. The writer's look for lost creates (a ListMultipartUploads) ran on the writing thread,
    between the create and the first part: every multipart file of a save waited one more round trip (a listing,
    paged, on a bucket with many uploads) before any byte went. It now runs beside the parts."""
    fs = _ListingWaitsForAPart(**s3_server.storage_options())
    config = dataclasses.replace(s3_server.config(), filesystem=fs)
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0, n=_BIG))
        assert fs.listing_waited_for_a_part == [True]  # before: [False], the part waited for the listing
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(1.0, n=_BIG)["model"]["w"])
