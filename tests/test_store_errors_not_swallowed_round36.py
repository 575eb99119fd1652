"""A store error the engine catches and gets past is told, once, on the `torch_checkpointing` logger.

The storage used to log every store error as a WARNING before raising it; since it raises without logging, a
caller that catches such an error and carries on was silent. Real failures of the real moto server, answered by
a fault proxy in front of it.
"""

from __future__ import annotations

import logging

import pytest

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing.errors import ObjectStoreError

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
