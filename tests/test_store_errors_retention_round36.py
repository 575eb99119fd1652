"""A store error that retention's gc catches and gets past is told, once, on the `torch_checkpointing` logger or
raised. Real failures of the real moto server, answered by a fault proxy in front of it."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_gc_older_claims_round34 import _earlier_builds_gc_claim
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing.commit import Claim
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.names import aside_name, host_tag, may_be_cut
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytest.importorskip("s3fs")


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def _told_by_gc(
    s3_server: S3Server, config: FsspecStorageConfig, rule: Rule, caplog: pytest.LogCaptureFixture
) -> list[str]:
    """What a gc of `run`, its requests failed by `rule`, told of the store's failure: its raise, or its
    WARNINGs naming the error."""
    with FaultProxy(s3_server.port, [rule]) as proxy:
        failing = through_proxy(config, proxy)
        try:
            collect_garbage(f"{failing.url}/run", failing.create_storage(), unowned_after_s=0)
        except ObjectStoreError as exc:
            return [str(exc)]
    return _warnings(caplog, "AccessDenied")


def _dead_claim() -> bytes:
    """The claim of a save whose process is gone on this host."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(60)
    claim = Claim("1" * 32, "", socket.gethostname(), proc.pid, time.time(), records=True)
    return json.dumps(dataclasses.asdict(claim), sort_keys=True).encode("utf-8")


def test_a_failed_read_of_a_dead_saves_claim_is_told_by_gc(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """gc tells a dead save's prefix (its `.incomplete` claim's process gone) from a live one by reading the
    claim again (`_dead_claim`). A store that refused that read (403) had its error dropped: the claim counted as
    maybe live, the prefix kept as "may still be writing it", and nothing said the store failed. Now gc stops
    with the store's error, the marker named."""
    config = s3_server.config()
    config.create_storage().write(Path("run/step_1") / INCOMPLETE_MARKER, _dead_claim())
    bucket = config.url.removeprefix("s3://")
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    # The first read (the listing's, which tells the marker ours) goes through; gc's read of the claim fails.
    rule = Rule(rf"^GET /{bucket}/run/step_1/\.incomplete", 403, "AccessDenied", after=1)
    told = _told_by_gc(s3_server, config, rule, caplog)
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert "run/step_1/.incomplete" in told[0] and "AccessDenied" in told[0], told


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(60)
    return proc.pid


def test_a_failed_read_of_the_step_of_a_copy_aside_is_told_by_gc(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy aside whose name was cut tells gc its id by the step its manifest records (`_recorded_step`): two
    long ids that differ past the cut make the same cut names. A store that refused that read (403) had its error
    dropped: any id of the name's start was taken for the copy's, and the copy removed as replaced, nothing said.
    Now gc stops with the store's error, the copy left."""
    config = s3_server.config()
    long_id = "r" * 240 + "_step_1"
    with sync_manager(config) as manager:
        manager.save(f"run/{long_id}", state(1.0))
    bucket = config.url.removeprefix("s3://")
    fs = config.create_storage().fs
    aside = aside_name(long_id, _a_dead_pid(), "0123abcd", host_tag())
    assert may_be_cut(aside)
    fs.copy(f"{bucket}/run/{long_id}", f"{bucket}/run/{aside}", recursive=True)  # a replace's copy left aside
    fs.invalidate_cache()
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    # The listing's read of the copy's manifest goes through; the next one (its step) fails, that one alone.
    rule = Rule(rf"^GET /{bucket}/run/\.old_[^?]*/manifest\.json", 403, "AccessDenied", after=1, times=1)
    told = _told_by_gc(s3_server, config, rule, caplog)
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert f"run/{aside}/manifest.json" in told[0] and "AccessDenied" in told[0], told
    fs.invalidate_cache()
    assert fs.exists(f"{bucket}/run/{aside}/manifest.json")


def test_a_failed_read_of_a_dead_saves_manifest_is_told_by_gc(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """gc collects a dead save held by a killed gc's claim by the files its manifest lists
    (`_dead_saves_manifest`). A store that refused that read (403) had its error dropped: the save's own files
    were left, named as "not written by this save (put there by a user ...)", the claim let go of, and what was
    left (manifest and data, no marker) became a committed checkpoint. Now the collection fails with the
    store's error, the claim kept (the next gc collects it), nothing committed."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/z", {"x": 1})
    storage.write(Path("run/z") / INCOMPLETE_MARKER, _earlier_builds_gc_claim())  # that build's gc, killed
    bucket = config.url.removeprefix("s3://")
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    # The listing's read of the manifest goes through; gc's read of the dead save's manifest fails, it alone.
    rule = Rule(rf"^GET /{bucket}/run/z/manifest\.json", 403, "AccessDenied", after=1, times=1)
    told = _told_by_gc(s3_server, config, rule, caplog)
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert "run/z/manifest.json" in told[0] and "AccessDenied" in told[0], told
    assert not _warnings(caplog, "not written by this save"), [r.getMessage() for r in caplog.records]
    assert not list_checkpoints(f"{config.url}/run", storage)
