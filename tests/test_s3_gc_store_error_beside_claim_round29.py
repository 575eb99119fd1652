"""gc whose read of a manifest beside a stray claim fails on the store never removes the committed checkpoint.

On an object store, a committed checkpoint with another save's dead claim beside it (a save killed right after
claiming the id another save had just committed) is committed: gc removes the claim alone. Round 28 made a
process short of descriptors at the manifest's read raise instead of judging. The same read failing on the store
(a 503 SlowDown through every retry, a 500) was still taken for "no manifest this engine reads": the checkpoint
read as an unfinished save whose claim is dead, and gc removed it whole. The store is the real test server, its
answers failed by a real HTTP proxy in front of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import s3fs
import torch

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server, missing_s3_packages
from tests.test_s3_attacks import sync_manager, through_proxy
from torch_checkpointing.commit import STALE_CLAIM_S, Claim
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.retention import collect_garbage

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")

_DEAD_CLAIM = Claim(token="tmp-deadjob-1", uid="deadjob", host="elsewhere", pid=1, created=0.0)


def _names(s3_server: S3Server, prefix: str) -> list[str]:
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    return sorted(Path(key).name for key in fs.find(prefix))


@pytest.mark.parametrize("what", [r"/run/x/manifest\.json", r"/run/x/\.incomplete"])
def test_gc_whose_read_beside_a_claim_fails_on_the_store_keeps_the_checkpoint(s3_server: S3Server, what: str) -> None:
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/x", {"model": {"w": torch.full((10,), 1.0)}})
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    assert _DEAD_CLAIM.created < STALE_CLAIM_S
    fs.pipe(f"{config.url}/run/x/.incomplete", _DEAD_CLAIM.to_bytes())
    written = _names(s3_server, f"{config.url}/run/x")
    port = s3_server.port
    with FaultProxy(port) as proxy:
        storage = through_proxy(config, proxy).create_storage()
        proxy.rules = [Rule(rf"^GET \S*{what}", 503, "SlowDown")]
        for dry_run in (True, False):
            try:
                report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0, dry_run=dry_run)
            except (OSError, CheckpointError) as exc:  # raised naming what failed: nothing judged
                assert "run/x" in str(exc), exc
            else:
                assert not [lo for lo in report.removed if lo.kind != "claim"], report
        with pytest.raises((OSError, CheckpointError)):
            list_leftovers(f"{config.url}/run", storage)  # was: run/x listed as an unfinished save
        proxy.rules = []
    assert _names(s3_server, f"{config.url}/run/x") in (written, [n for n in written if n != ".incomplete"])
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/x")["model"]["w"], torch.full((10,), 1.0))
