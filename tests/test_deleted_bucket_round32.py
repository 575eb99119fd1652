"""A bucket deleted after the storage's first look at it, against the real moto server (tests/s3_server.py).

s3fs answers a request in a missing bucket with a FileNotFoundError (whose cause says NoSuchBucket), or swallows
it into False / []. The storage's own bucket check HEADs a bucket once, on its first miss, and then trusts it, so a
bucket deleted later (a lifecycle rule, an operator) read as an empty run: a resume started from scratch and
retention found nothing to keep.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.s3_server import S3Server
from torch_checkpointing.discovery import latest_checkpoint, list_checkpoints
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.storage.fsspec_storage import FsspecStorage


def _storage_of_a_deleted_bucket(s3_server: S3Server) -> tuple[FsspecStorage, str]:
    """A storage that saw its bucket (a miss checked it), whose bucket was then emptied and deleted."""
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    storage = config.create_storage()
    storage.write(Path("run/step_1/model_0.pt"), b"weights")
    with pytest.raises(FileNotFoundError):
        storage.getsize(Path("run/absent.pt"))  # the first miss: the bucket is checked, and there
    storage.fs.call_s3("delete_object", Bucket=bucket, Key="run/step_1/model_0.pt")
    storage.fs.call_s3("delete_bucket", Bucket=bucket)
    return storage, bucket


def test_lookups_in_a_bucket_deleted_after_its_check_name_the_bucket(s3_server: S3Server) -> None:
    """Before: isdir False, tree_bytes 0, objects_by_save empty, rmdir a silent no-op, and latest_checkpoint None
    (a resume from scratch); changed_at and unfinished_uploads a bare FileNotFoundError ("gone")."""
    storage, bucket = _storage_of_a_deleted_bucket(s3_server)
    run = Path("run")
    lookups: dict[str, Callable[[], Any]] = {
        "isdir": lambda: storage.isdir(run),
        "isdir of a checkpoint": lambda: storage.isdir(run / "step_1"),
        "tree_bytes": lambda: storage.tree_bytes(run),
        "changed_at": lambda: storage.changed_at(run),
        "objects_by_save": lambda: storage.objects_by_save(run),
        "unfinished_uploads": lambda: storage.unfinished_uploads(run),
        "rmdir": lambda: storage.rmdir(run / "step_1"),
        "latest_checkpoint": lambda: latest_checkpoint(f"s3://{bucket}/run", storage),
        "list_checkpoints": lambda: list_checkpoints(f"s3://{bucket}/run", storage),
    }
    for name, lookup in lookups.items():
        try:
            answer = lookup()
        except ObjectStoreError as exc:
            assert f"the bucket {bucket!r} does not exist" in str(exc) and "create it" in str(exc), (name, exc)
        else:
            pytest.fail(f"{name} answered {answer!r} in a bucket that no longer exists")


def test_a_delete_in_a_deleted_bucket_is_no_not_found_a_caller_may_swallow(s3_server: S3Server) -> None:
    """`delete` raised a bare FileNotFoundError, which every caller that deletes "if still there" suppresses:
    a gc or a retention pass reported the checkpoint deleted. Now the bucket is named; a missing key in a bucket
    that exists stays quiet, as S3's own DeleteObject is."""
    storage, bucket = _storage_of_a_deleted_bucket(s3_server)
    with pytest.raises(ObjectStoreError, match=rf"delete of s3://{bucket}/run/step_1/model_0.pt failed: the bucket"):
        storage.delete(Path("run/step_1/model_0.pt"))
    there = s3_server.config().create_storage()
    there.delete(Path("run/absent.pt"))


def test_isdir_and_tree_bytes_in_a_bucket_that_exists_answer_as_before(s3_server: S3Server) -> None:
    """The fix reads the store's own answer: an empty prefix in a bucket that exists is still False."""
    storage = s3_server.config().create_storage()
    storage.write(Path("run/step_1/model_0.pt"), b"weights")
    assert storage.isdir(Path("run")) and storage.isdir(Path("run/step_1"))
    assert not storage.isdir(Path("run/step_2")) and not storage.isdir(Path("run/step_1/model_0.pt"))
    assert storage.isdir(Path(""))  # the bucket's root
    assert storage.tree_bytes(Path("run")) == len(b"weights") and storage.tree_bytes(Path("nothing")) == 0


def test_an_empty_bucket_s_root_is_a_directory_with_nothing_saved(s3_server: S3Server) -> None:
    """The other side: the root of a bucket that exists but holds nothing (a run not yet saved to) is a directory
    that lists no checkpoint. The listing that replaced s3fs's `isdir` told it "a file, not a directory"."""
    config = s3_server.config()
    storage = config.create_storage()
    assert latest_checkpoint(config.url, storage) is None
    assert list_checkpoints(config.url, storage) == []
