"""Object-store defects found in round 25, against a real S3 API server (moto) on loopback.

* A directory move on S3 (retention putting a whole copy back under its id, gc putting a trash back) put its
  `.incomplete` marker up with a plain PUT. The caller checked that no save held the id first, but a save that
  claimed the id after that check lost its claim to the PUT (and the move's copy then mixed its files with the
  save's): the marker is now created only if absent, or replaces only a dead claim of ours still as judged.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.s3_faults import LOST, FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing.commit import Claim
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.names import host_tag, trash_name
from torch_checkpointing.retention import collect_garbage, delete_checkpoint

pytest.importorskip("s3fs")


def _live_claim_of_a_save() -> bytes:
    """The claim a save of this (live) process makes before its first upload."""
    return Claim("step_9.tmp-ab12cd34-1", "", socket.gethostname(), os.getpid(), time.time(), tags=True).to_bytes()


def test_a_move_onto_an_id_a_save_has_claimed_leaves_the_claim_and_moves_nothing(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    claim = _live_claim_of_a_save()
    marker = Path("run/step_9") / INCOMPLETE_MARKER
    assert storage.create_object(marker, claim)  # a save claims the id after the mover's check
    with pytest.raises(ObjectStoreError, match=r"run/step_9/\.incomplete") as refused:
        storage.rename(Path("run/step_1"), Path("run/step_9"), is_directory=True)
    assert "another save" in str(refused.value), refused.value
    assert storage.read(marker) == claim  # the save still holds its id
    assert storage.ls(Path("run/step_9")) == [INCOMPLETE_MARKER]  # and nothing was copied among its files
    with sync_manager(config) as manager:  # the source is as it was
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(1.0)["model"]["w"])


# ---------------------------------------------------------------- an endpoint that ignores conditional requests
#
# Every guarantee of the object-store commit rests on conditional requests: a claim created only if absent
# (`If-None-Match: *`), a dead claim replaced and an object deleted only while still the version judged
# (`If-Match`). An S3-compatible endpoint that ignores those headers (older MinIO and Ceph releases, some
# gateways) answered every such request with success: two saves of one id both held it, a manifest replaced
# another, and nothing said so. Now the first claim a storage creates in a bucket is checked: the same bytes
# again under `If-None-Match: *`, and under an `If-Match` naming no version, must both be refused.


def test_a_save_to_an_endpoint_that_ignores_conditional_requests_is_refused(s3_server: S3Server) -> None:
    config = s3_server.config()
    port = s3_server.port
    with FaultProxy(port, drop_headers=("if-none-match", "if-match")) as proxy:
        endpoint = proxy.endpoint
        manager = sync_manager(through_proxy(config, proxy))
        with manager, pytest.raises(ObjectStoreError, match=r"ignores conditional requests") as refused:
            manager.save("run/step_1", state(1.0))
    assert "If-None-Match" in str(refused.value) and endpoint in str(refused.value), refused.value
    storage = config.create_storage()
    assert not storage.exists(Path("run/step_1") / INCOMPLETE_MARKER)  # its claim went, and nothing was written
    assert not storage.exists(Path("run/step_1") / MANIFEST_FILE_NAME)


def test_an_endpoint_that_honours_conditional_requests_is_checked_once_per_bucket(s3_server: S3Server) -> None:
    config = s3_server.config()
    port = s3_server.port
    with FaultProxy(port) as proxy:
        with sync_manager(through_proxy(config, proxy)) as manager:
            manager.save("run/step_1", state(1.0))
            manager.save("run/step_2", state(2.0))
        puts = [line for line in proxy.seen if line.startswith("PUT ") and INCOMPLETE_MARKER in line]
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/step_2")["model"]["w"], state(2.0)["model"]["w"])
    assert len(puts) == 2 + 2, puts  # one claim a save, and the check's two refused PUTs once


# ------------------------------------------------------- the age of another host's hidden copy on an object store
#
# gc keeps a trash (or aside copy) whose maker it cannot check (another host's) until it is `unowned_after_s` old.
# Its age came from a local path's mtime only: on an object store it was 0 for ever, so such a trash was never
# collected ("only 0s old"), whatever its age. A move on an object store copies every object, so the newest
# object's LastModified under the prefix is when the copy got its name.


def test_gc_ages_another_hosts_trash_on_s3_by_when_it_was_made(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    other = "0badc0de" if host_tag() != "0badc0de" else "0badc0df"
    trash = trash_name("step_1", 4242, "abcdef01", other)
    storage.rename(Path("run/step_1"), Path("run") / trash, is_directory=True)  # another host's retention
    root = f"{config.url}/run"
    young = collect_garbage(root, storage, unowned_after_s=30)
    assert [lo.path for lo, _ in young.kept] == [f"{root}/{trash}"], young
    time.sleep(1.5)  # S3 times are whole seconds
    old = collect_garbage(root, storage, unowned_after_s=1)
    assert [lo.path for lo in old.removed] == [f"{root}/{trash}"], old
    assert not storage.exists(Path("run") / trash)


# ------------------------------------------------------------- a manifest create whose answer is lost, logged
#
# The manifest's conditional create, done by the server with its answer lost, is retried by the client and
# refused: the commit then finds its own manifest there and commits. But the refusal was logged at ERROR on the
# way ("another save committed this checkpoint while this one ran. This save was not committed"), for a save
# that committed: an operator's alerting saw a failed save that never was.


def test_a_manifest_create_whose_answer_is_lost_logs_no_failure(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    config = s3_server.config()
    port = s3_server.port
    with FaultProxy(port) as proxy:
        proxy.rules = [Rule(rf"^PUT \S*/{MANIFEST_FILE_NAME} ", LOST, times=1)]
        with (
            caplog.at_level(logging.WARNING, logger="torch_checkpointing"),
            sync_manager(through_proxy(config, proxy)) as manager,
        ):
            manager.save("run/step_1", state(1.0))
        assert sum(MANIFEST_FILE_NAME in line and line.startswith("PUT ") for line in proxy.seen) == 2
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(1.0)["model"]["w"])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    said = [r.getMessage() for r in caplog.records if r.name.startswith("torch_checkpointing")]
    assert any("the manifest in the store is this save's" in m and "the save is committed" in m for m in said), said
    # Nor at WARNING: the refusal's own words ("This save was not committed; save under a new id") are not true.
    assert not any("not committed" in m or "under a new id" in m for m in said), said


# ------------------------------------------------------- a move's marker whose answer is lost
#
# The marker a directory move (or a delete) puts up is created only if absent. Its create, done by the server
# with the answer lost, is retried by the client and refused: the marker is there, and it is the mover's own. The
# move then failed, saying "held by another save", and left its claim at the destination (a rename) or gave up
# the delete, where the plain PUT of before had simply been retried.


@pytest.mark.parametrize("operation", ["rename", "delete"])
def test_a_moves_marker_whose_answer_is_lost_is_taken_as_put_up(s3_server: S3Server, operation: str) -> None:
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    port = s3_server.port
    with FaultProxy(port) as proxy:
        proxy.rules = [Rule(rf"^PUT \S*/{INCOMPLETE_MARKER} ", LOST, times=1)]
        storage = through_proxy(config, proxy).create_storage()
        if operation == "rename":
            storage.rename(Path("run/step_1"), Path("run/step_9"), is_directory=True)
        else:  # what retention and prune do: the checkpoint moved to its trash name, then removed
            assert delete_checkpoint(f"{config.url}/run/step_1", storage)
        to = "/run/step_9/" if operation == "rename" else ".trash-"  # the marker the move puts up at its destination
        puts = [line for line in proxy.seen if line.startswith("PUT ") and to in line and INCOMPLETE_MARKER in line]
        assert len(puts) >= 2 and puts[0] == puts[1], puts  # the lost one, and the client's retry of it
    plain = config.create_storage()
    left = sorted(k.split("/", 1)[1] for k in plain.fs.find(config.url[len("s3://") :]))
    if operation == "rename":
        assert left == [f"run/step_9/{name}" for name in ("manifest.json", "meta_0.pt", "model_0.pt")], left
        with sync_manager(config) as manager:
            assert torch.equal(manager.load("run/step_9")["model"]["w"], state(1.0)["model"]["w"])
    else:
        assert left == [], left
