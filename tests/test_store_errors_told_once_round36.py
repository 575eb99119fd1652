"""A store error a library call raises is told once: by the raise, not also as a WARNING of the storage.

The storage logged every store error it raised (a WARNING on the `torch_checkpointing` logger), and then raised
it: a program that reports its errors (or a logger with a handler) told one missing bucket, one refused request
twice. The CLI held those WARNINGs back; a library user got both. Errors a caller swallows are logged by that
caller (a failed cleanup, a deletion a report lists), which is where a WARNING belongs.

Real failures of the real moto server: a bucket removed after the checkpoint was saved, and a 403 answered by
a fault proxy in front of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing import latest_checkpoint, list_checkpoints
from torch_checkpointing.errors import ObjectStoreError, exception_chain
from torch_checkpointing.retention import RetentionPolicy, collect_garbage, prune
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytest.importorskip("s3fs")

_Call = Callable[[FsspecStorageConfig], Any]


def _load(config: FsspecStorageConfig) -> Any:
    with sync_manager(config) as manager:
        return manager.load("run/step_1")


def _save(config: FsspecStorageConfig) -> None:
    with sync_manager(config) as manager:
        manager.save("run/step_2", state(2.0))


_CALLS: dict[str, _Call] = {
    "load": _load,
    "latest": lambda config: latest_checkpoint(f"{config.url}/run", config.create_storage()),
    "list": lambda config: list_checkpoints(f"{config.url}/run", config.create_storage()),
    "prune": lambda config: prune(f"{config.url}/run", RetentionPolicy(keep_last=1), config.create_storage()),
    "gc": lambda config: collect_garbage(f"{config.url}/run", config.create_storage()),
}


def _saved(s3_server: S3Server) -> FsspecStorageConfig:
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    return config


def _remove_bucket(config: FsspecStorageConfig) -> None:
    storage = config.create_storage()
    bucket = config.url.removeprefix("s3://")
    for key in storage.fs.find(bucket):
        storage.fs.rm(key)
    storage.fs.call_s3("delete_bucket", Bucket=bucket)


def _store_error(call: _Call, config: FsspecStorageConfig) -> ObjectStoreError:
    with pytest.raises(Exception) as raised:
        call(config)
    found = [e for e in exception_chain(raised.value) if isinstance(e, ObjectStoreError)]
    assert found, repr(raised.value)
    return found[0]


def _told_again(caplog: pytest.LogCaptureFixture, error: ObjectStoreError) -> list[str]:
    text = str(error)
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.WARNING and text in r.getMessage()
    ]


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_a_missing_bucket_is_raised_and_not_also_logged(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    config = _saved(s3_server)
    _remove_bucket(config)
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    error = _store_error(_CALLS[name], config)
    assert "NoSuchBucket" in str(error), error
    assert _told_again(caplog, error) == []


@pytest.mark.parametrize("name", ["load", "latest", "list"])
def test_a_refused_request_is_raised_and_not_also_logged(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    config = _saved(s3_server)
    bucket = config.url.removeprefix("s3://")
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with FaultProxy(s3_server.port, [Rule(rf"^(GET|HEAD) /{bucket}", status=403, code="AccessDenied")]) as proxy:
        error = _store_error(_CALLS[name], through_proxy(config, proxy))
    assert "AccessDenied" in str(error), error
    assert _told_again(caplog, error) == []


def test_a_sync_save_to_a_missing_bucket_is_raised_and_reported_once_by_the_save(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """The save's own ERROR line (naming the checkpoint and what was committed) is its report; the storage's
    WARNING of the same error was a second telling."""
    config = _saved(s3_server)
    _remove_bucket(config)
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    error = _store_error(_save, config)
    told = _told_again(caplog, error)
    assert len(told) == 1 and "Checkpoint save of" in told[0], told


def test_a_refused_read_of_the_manifest_at_the_id_fails_the_save_as_the_stores_error(s3_server: S3Server) -> None:
    """A save of an id that holds a checkpoint reads its manifest first. A store that refused that read (403)
    had its error caught as any `CheckpointError` and the save refused with "its manifest.json is not a
    torch_checkpointing manifest. Choose another id": a healthy checkpoint called foreign, and the store's error
    (what to grant) told only by the storage's WARNING, now gone. It is raised as the store's error."""
    config = _saved(s3_server)
    bucket = config.url.removeprefix("s3://")
    rule = Rule(rf"^GET /{bucket}/run/step_1/manifest\.json", status=403, code="AccessDenied")
    with (
        FaultProxy(s3_server.port, [rule]) as proxy,
        sync_manager(through_proxy(config, proxy)) as manager,
        pytest.raises(ObjectStoreError) as raised,
    ):
        manager.save("run/step_1", state(2.0))
    told = str(raised.value)
    assert "AccessDenied" in told and "not a torch_checkpointing manifest" not in told, told
    with sync_manager(config) as manager:
        assert float(manager.load("run/step_1")["model"]["w"][0]) == 1.0
