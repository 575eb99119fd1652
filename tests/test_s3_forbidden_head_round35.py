"""A HEAD the store forbids (403) says what to do, as a forbidden GET or listing does.

S3 answers a HEAD with no body, so the client's error code is the bare status ("403") and the storage's
error said only "PermissionError: Forbidden": a listing or a load stopped at a manifest's or a marker's HEAD
(a policy without s3:GetObject, or a missing object with no s3:ListBucket) named no permission and no fix,
where a GET or a listing refused the same way named both.
"""

from __future__ import annotations

import pytest

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing import list_checkpoints
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.manifest import MANIFEST_FILE_NAME

pytest.importorskip("s3fs")


def test_a_forbidden_head_of_a_manifest_names_the_url_and_the_permissions(s3_server: S3Server) -> None:
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    head = rf"HEAD /{bucket}/run/step_1/{MANIFEST_FILE_NAME}"
    with FaultProxy(s3_server.port, [Rule(head, status=403, code="AccessDenied")]) as proxy:
        forbidden = through_proxy(config, proxy)
        with pytest.raises(ObjectStoreError) as refused:
            list_checkpoints(f"{config.url}/run", forbidden.create_storage())
    told = str(refused.value)
    assert f"{config.url}/run/step_1/{MANIFEST_FILE_NAME}" in told, told
    assert "s3:GetObject" in told and "s3:ListBucket" in told, told
