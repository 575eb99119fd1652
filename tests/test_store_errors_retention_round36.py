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
from tests.test_s3_attacks import through_proxy
from torch_checkpointing.commit import Claim
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("s3fs")


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


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
    with FaultProxy(s3_server.port, [rule]) as proxy:
        failing = through_proxy(config, proxy)
        try:
            collect_garbage(f"{failing.url}/run", failing.create_storage(), unowned_after_s=0)
        except ObjectStoreError as exc:
            told = [str(exc)]
        else:
            told = _warnings(caplog, "AccessDenied")
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert "run/step_1/.incomplete" in told[0] and "AccessDenied" in told[0], told
