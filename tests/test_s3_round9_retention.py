"""Retention on an object store that refuses deletes: the pass reports what it left, it does not raise.

A rename on S3 is a copy and a delete; when the store refuses the delete (a bucket policy denying
s3:DeleteObject), the storage raises ObjectStoreError, which retention did not catch (it caught OSError only):
`prune` raised out of the pass, a background retention pass logged only "failed", and the full copy left
beside the checkpoint was named nowhere.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest

from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from tests.test_s3_round9 import _DeleteDenyingProxy, _w
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.retention import RetentionPolicy, prune
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def test_a_store_that_refuses_the_delete_is_a_failure_named_in_the_report(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    config = s3_server.config()
    port = s3_server.port
    with sync_manager(config) as manager:
        manager.save("ret/step_1", state(1.0))
        manager.save("ret/step_2", state(2.0))
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with _DeleteDenyingProxy(port) as proxy:
        denied = through_proxy(config, proxy).create_storage()
        report = prune("ret", RetentionPolicy(keep_last=1), storage=denied)
    assert report.deleted == []
    assert [(Path(info.path).name, "step_1" in why) for info, why in report.failed] == [("step_1", True)]
    why = report.failed[0][1]
    assert "AccessDenied" in why or "s3:DeleteObject" in why, why
    assert "ret/step_1" in caplog.text
    plain = config.create_storage()
    leftovers = [name for name in plain.ls(Path("ret")) if "trash" in name]
    for name in leftovers:  # a copy the refused rename left beside it is named, for a later gc
        assert name in why or name in caplog.text, (name, why, caplog.text)
    with sync_manager(config) as manager:  # both checkpoints are whole
        assert _w(manager.load("ret/step_1")) == 1.0 and _w(manager.load("ret/step_2")) == 2.0
    assert [Path(c.path).name for c in list_checkpoints("ret", storage=plain)] == ["step_1", "step_2"]


def test_the_callers_storage_options_are_never_changed_under_them(s3_server: S3Server) -> None:
    """botocore fills in a `retries` dict given in config_kwargs (adding total_max_attempts): the storage
    passed the caller's nested dicts to fsspec as they were, so the caller's config changed, and a manager that
    checks its config for changes after construction refused its own next save."""
    bucket = s3_server.config()
    retries = {"max_attempts": 2, "mode": "standard"}
    options = {**s3_server.storage_options(), "config_kwargs": {"read_timeout": 5, "retries": retries}}
    before = copy.deepcopy(options)
    config = FsspecStorageConfig(url=bucket.url, part_size=bucket.part_size, storage_options=options)
    with sync_manager(config) as manager:
        manager.save("opts/step_1", state(1.0))
        manager.save("opts/step_2", state(2.0))
        assert _w(manager.load("opts/step_2")) == 2.0
    assert options == before and retries == before["config_kwargs"]["retries"]
