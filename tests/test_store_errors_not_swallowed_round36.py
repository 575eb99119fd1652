"""A store error the engine catches and gets past is told, once, on the `torch_checkpointing` logger.

The storage used to log every store error as a WARNING before raising it; since it raises without logging, a
caller that catches such an error and carries on was silent. Real failures of the real moto server, answered by
a fault proxy in front of it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.names import aside_name, host_tag
from torch_checkpointing.retention import collect_garbage, delete_checkpoint
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytest.importorskip("s3fs")


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_a_failed_read_of_whether_a_failed_save_committed_is_told(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """The marker's removal (the commit) fails, and so does every read of the manifest at the id that would tell
    whether the store did it: the save is reported failed, and the WARNING says the id may hold it. Before, the
    read's error was dropped (`except Exception: return False`) and nothing said the outcome was unknown."""
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    rules = [
        Rule(rf"^DELETE /{bucket}/run/step_1/\.incomplete"),
        Rule(rf"^GET /{bucket}/run/step_1/manifest\.json", status=403, code="AccessDenied"),
    ]
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with (
        FaultProxy(s3_server.port, rules) as proxy,
        sync_manager(through_proxy(config, proxy)) as manager,
        pytest.raises(ObjectStoreError, match=r"delete of .*run/step_1/\.incomplete"),
    ):
        manager.save("run/step_1", state(1.0))
    told = _warnings(caplog, "Could not tell whether checkpoint")
    assert len(told) == 1, [r.getMessage() for r in caplog.records]  # once, though asked again by the clean-up
    assert "run/step_1/manifest.json" in told[0] and "AccessDenied" in told[0], told
    report = _warnings(caplog, "Checkpoint save of")
    assert len(report) == 1 and "may have been committed" in report[0], report  # not "nothing was committed"


@pytest.fixture
def live_pid() -> Iterator[int]:
    """A live process of this host, started before the copy aside a test makes names it as its maker."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _moved_aside(s3_server: S3Server, pid: int, host: str) -> FsspecStorageConfig:
    """run/step_1 saved, then moved aside as a replace by process `pid` of host `host` leaves it between its two
    renames (`.old_step_1_<pid>-<nonce>-<host>`): the id holds nothing."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    bucket = config.url.removeprefix("s3://")
    fs = config.create_storage().fs
    aside = aside_name("step_1", pid, "0123abcd", host)
    fs.copy(f"{bucket}/run/step_1", f"{bucket}/run/{aside}", recursive=True)
    fs.rm(f"{bucket}/run/step_1", recursive=True)
    fs.invalidate_cache()
    return config


def _age_unreadable(bucket: str) -> Rule:
    """The listings of every object under the copy aside but the first (gc's count of its bytes) answered 403:
    its age (`Storage.changed_at`) cannot be read."""
    return Rule(rf"^GET /{bucket}\?list-type=2&prefix=run%2F\.old_[^&]*&delimiter=&", 403, "AccessDenied", after=1)


@pytest.mark.parametrize("here", [True, False], ids=["made-here", "other-host"])
def test_a_failed_read_of_a_copy_asides_age_is_told_by_gc(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture, live_pid: int, here: bool
) -> None:
    """Whether a copy aside is a live replace's, or an old one gc puts back, hangs on its age read from the store
    (against its maker's start where the maker is a live process here, `_started_after`; against the unowned
    age where it is another host's, `_age_s`). A store that failed that read had its error dropped: the maker
    counted as live, the copy as young, and gc went on without a word of the store's failure. Now the store's
    error is raised: out of gc, or into gc's WARNING that it could not look at the copies."""
    config = _moved_aside(s3_server, live_pid, host_tag() if here else "0badcafe")
    bucket = config.url.removeprefix("s3://")
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with FaultProxy(s3_server.port, [_age_unreadable(bucket)]) as proxy:
        failing = through_proxy(config, proxy)
        try:
            collect_garbage(f"{failing.url}/run", failing.create_storage())
        except ObjectStoreError as exc:
            told = [str(exc)]
        else:
            told = _warnings(caplog, "AccessDenied")
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert "run/.old_step_1_" in told[0], told


def test_a_failed_read_of_a_checkpoints_manifest_fails_its_delete_as_the_stores_error(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A delete first tells the checkpoint's own files from others' (`files_not_listed`), by its manifest. A
    store that refused that read (403) had its error dropped: every file, the manifest too, was called "not part
    of it", and the delete refused for files the user should move out. Now the delete is refused for what it is:
    its files could not be listed, the store's error named."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    bucket = config.url.removeprefix("s3://")
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    rule = Rule(rf"^GET /{bucket}/run/step_1/manifest\.json", status=403, code="AccessDenied")
    with FaultProxy(s3_server.port, [rule]) as proxy:
        failing = through_proxy(config, proxy)
        assert not delete_checkpoint(f"{failing.url}/run/step_1", failing.create_storage())
    told = _warnings(caplog, "run/step_1")
    assert len(told) == 1 and "AccessDenied" in told[0], told
    assert "not part of it" not in told[0], told
    with sync_manager(config) as manager:  # left whole
        assert float(manager.load("run/step_1")["model"]["w"][0]) == 1.0
