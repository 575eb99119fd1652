"""A delete that cannot read the claim beside a committed checkpoint stops before deleting anything.

Beside a live claim (a save on another host), the delete reads the claim to learn whether it owns the manifest
(`_owned_by_marker`): then the manifest goes after the files it lists, else first. Every error of that read was
taken for "not ours": a store refusing it (403, a 503 after the client's retries) silently picked the
manifest-first order, and the delete went on under a claim it never read.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server, missing_s3_packages
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing.commit import Claim
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")


def test_a_forbidden_read_of_the_claim_stops_the_delete_before_anything_goes(s3_server: S3Server) -> None:
    """Defect: the rmdir returned and run/step_1 was gone, its claim never read."""
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    storage = config.create_storage()
    elsewhere = Claim("a-save-elsewhere", "", "another-host.invalid", 1, time.time())
    assert storage.create_object(Path(f"run/step_1/{INCOMPLETE_MARKER}"), elsewhere.to_bytes())
    before = sorted(storage.ls(Path("run/step_1")))
    # the first GET of the claim (the live-save check before the delete) passes; every later one is refused
    marker_get = rf"GET /{bucket}/run/step_1/\{INCOMPLETE_MARKER}[ ?]"
    with FaultProxy(s3_server.port, [Rule(marker_get, status=403, code="AccessDenied", after=1)]) as proxy:
        refusing = through_proxy(config, proxy).create_storage()
        with pytest.raises(ObjectStoreError, match=r"delete of s3://\S+/run/step_1 failed.*s3:GetObject"):
            refusing.rmdir(Path("run/step_1"))
    assert sorted(storage.ls(Path("run/step_1"))) == before
    assert storage.exists(Path(f"run/step_1/{MANIFEST_FILE_NAME}"))


def test_a_forbidden_read_back_of_the_delete_s_claim_is_not_told_as_another_save(s3_server: S3Server) -> None:
    """Where the store refuses the delete's conditional PUT of its claim (412), the delete reads the marker back
    to learn whether the PUT was its own, retried (`_is_up`). Defect: a store refusing that read was told as
    "run/step_1/.incomplete is held by another save (a claim put up after this one's check (another save))"."""
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    storage = config.create_storage()
    before = sorted(storage.ls(Path("run/step_1")))
    marker = rf"/{bucket}/run/step_1/\{INCOMPLETE_MARKER}[ ?]"
    rules = [
        Rule(f"PUT {marker}", status=412, code="PreconditionFailed"),
        Rule(f"GET {marker}", status=403, code="AccessDenied"),
    ]
    with FaultProxy(s3_server.port, rules) as proxy, pytest.raises(ObjectStoreError) as refused:
        through_proxy(config, proxy).create_storage().rmdir(Path("run/step_1"))
    told = str(refused.value)
    assert "held by another save" not in told and "s3:GetObject" in told, told
    assert sorted(storage.ls(Path("run/step_1"))) == before
