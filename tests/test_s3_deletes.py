"""Deleting a checkpoint on S3 (retention, gc, `FsspecStorage.rmdir`) never leaves a state nothing recognises.

Before, the prefix was deleted in one bulk request in no particular order: a delete that failed midway (a 5xx,
a killed process) could leave a committed manifest whose files were gone, or files with neither manifest nor
marker, which gc does not recognise as ours and so never collects. Now the checkpoint is marked `.incomplete`
(a claim naming the manifest's save: from then on it reads as incomplete), its files go next, then its manifest
(round 35: it went first, and a failure among the files left them named by nothing), the marker last. Against
a real S3 API server (moto), with the bulk delete failed by a loopback proxy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing import list_checkpoints
from torch_checkpointing.errors import IncompleteCheckpointError, ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.retention import collect_garbage


def test_a_delete_that_fails_midway_leaves_an_incomplete_save_that_gc_collects(s3_server: S3Server) -> None:
    config = s3_server.config()
    port = s3_server.port
    storage = config.create_storage()
    with FaultProxy(port) as proxy:
        through = through_proxy(config, proxy)
        with sync_manager(through) as manager:
            manager.save("run/step_1", state(1.0))
            manager.save("run/step_2", state(2.0))
            proxy.rules = [Rule(r"^POST \S*\?delete", 500, "InternalError")]  # the bulk delete of the files fails
            with pytest.raises(ObjectStoreError, match=r"run/step_1"):
                through.create_storage().rmdir(Path("run/step_1"))
            proxy.rules = []
            assert storage.exists(Path("run/step_1") / MANIFEST_FILE_NAME)  # the list of what is left ...
            assert storage.exists(Path("run/step_1") / INCOMPLETE_MARKER)  # ... owned by the delete's claim
            assert storage.exists(Path("run/step_1/model_0.pt"))  # the files are still there ...
            with pytest.raises(IncompleteCheckpointError):  # ... but nothing loads them as a checkpoint
                manager.load("run/step_1")
            assert [c.name for c in list_checkpoints(f"{config.url}/run", storage)] == ["step_2"]
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    # ... and gc recognises them and removes them
    assert [Path(lo.path).name for lo in report.removed] == ["step_1"], report.kept
    assert not storage.exists(Path("run/step_1/model_0.pt"))
    assert [c.name for c in list_checkpoints(f"{config.url}/run", storage)] == ["step_2"]


def test_a_delete_that_succeeds_leaves_nothing(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    storage.rmdir(Path("run/step_1"))
    assert not storage.exists(Path("run/step_1") / INCOMPLETE_MARKER)
    assert not storage.exists(Path("run/step_1/model_0.pt")) and not storage.isdir(Path("run/step_1"))
