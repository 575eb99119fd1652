"""A store that keeps failing (5xx through every retry) says what to do, as a refusal does.

A listing the store answered with InternalError, SlowDown or ServiceUnavailable through every retry failed
with "OSError: [Errno 121] ..." and no word of what to do: a user could not tell a failing store (wait, retry)
from a fault of theirs. It is raised, never read as an empty run.
"""

from __future__ import annotations

import pytest

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing import list_checkpoints
from torch_checkpointing.errors import ObjectStoreError

pytest.importorskip("s3fs")


@pytest.mark.parametrize(
    ("status", "code"), [(500, "InternalError"), (503, "SlowDown"), (503, "ServiceUnavailable")], ids=lambda v: str(v)
)
def test_a_listing_the_store_keeps_failing_is_raised_saying_to_retry_later(
    s3_server: S3Server, status: int, code: str
) -> None:
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    with FaultProxy(s3_server.port, [Rule(rf"GET /{bucket}\?", status=status, code=code)]) as proxy:
        failing = through_proxy(config, proxy)
        with pytest.raises(ObjectStoreError) as refused:
            list_checkpoints(f"{config.url}/run", failing.create_storage())
    told = str(refused.value)
    assert f"{config.url}/run" in told and code in told, told
    assert "try again later" in told, told
