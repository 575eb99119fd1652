"""Two saves of one id on S3: a save claims the id before its first upload, and a failed save never damages
a committed checkpoint. Real processes against a real S3 server (moto on loopback, tests/s3_server.py).

There is no rename on an object store, so every save writes its files straight under the id. The conditional
manifest let only one of two concurrent saves commit, but the other's data uploads still landed on the same
keys: after the first had committed, its objects were overwritten (a load refused them by CRC32, while
`latest_checkpoint`, which checks no checksums, returned the damaged checkpoint), or its `.incomplete` marker
came back and the committed checkpoint read as unfinished. Now the marker is created conditionally
(`If-None-Match: *`) and carries the save's claim; a second save is refused before it uploads anything, and a
claim whose owner is provably gone (a killed job, on this host) is taken over with `If-Match`.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_server import S3Server
from tests.test_s3_attacks import _held_save, state, sync_manager
from torch_checkpointing import CheckpointManager, latest_checkpoint
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CommitError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

DAY_S = 24 * 3600.0


def _finish(child: Any, release: Path) -> str:
    release.touch()
    try:
        return str(child.communicate(timeout=120)[0].decode(errors="replace"))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)


def _assert_committed_intact(config: FsspecStorageConfig, checkpoint_id: str, expected: dict[str, Any]) -> None:
    """The id holds exactly `expected`, committed: no marker, found by `latest_checkpoint`, loads bit for bit."""
    storage = config.create_storage()
    run, name = checkpoint_id.rsplit("/", 1)
    assert not storage.exists(Path(checkpoint_id) / INCOMPLETE_MARKER), "the committed checkpoint has a marker again"
    latest = latest_checkpoint(f"{config.url}/{run}", storage)
    assert latest is not None and latest.name == name
    with sync_manager(config) as manager:
        got = manager.load(checkpoint_id)
    assert torch.equal(got["model"]["w"], expected["model"]["w"]) and got["meta"] == expected["meta"]


def test_a_save_that_reaches_the_store_after_another_committed_the_id_writes_nothing_there(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The child passes the manager's check of the id (no manifest yet) and pauses before its first write; the
    test commits the id; the child then wrote its marker and data over the committed checkpoint."""
    config = s3_server.config()
    child = _held_save(s3_server, config, tmp_path, "run/contested", "claim")
    try:
        with sync_manager(config) as manager:
            manager.save("run/contested", state(2.0))
    finally:
        output = _finish(child, tmp_path / "release")
    assert "FAILED CommitError" in output and "run/contested" in output, output[-3000:]
    _assert_committed_intact(config, "run/contested", state(2.0))


@pytest.mark.parametrize("saver", ["sync", "async"])
def test_a_second_save_of_an_id_being_written_is_refused_before_it_uploads(
    s3_server: S3Server, tmp_path: Path, saver: str
) -> None:
    """The child has claimed the id and pauses before its first data upload. A second save of the id used to
    commit meanwhile, and the child's upload then replaced the committed model_0.pt: `latest_checkpoint`
    returned a checkpoint that no longer loads. Now the second save is refused naming the id and the holder,
    and deletes nothing of the child's, which commits."""
    config = s3_server.config()
    child = _held_save(s3_server, config, tmp_path, "run/contested", "data")
    save = AsyncCheckpointSaverConfig() if saver == "async" else SyncCheckpointSaverConfig()
    try:
        manager = CheckpointManager(CheckpointManager.Config(save=save, storage_config=config))
        with manager, pytest.raises(CommitError) as refused:
            written = manager.save("run/contested", state(2.0))
            if saver == "async":
                written.result(timeout=120)
        message = str(refused.value)
        assert "run/contested" in message and "another save" in message and socket.gethostname() in message
    finally:
        output = _finish(child, tmp_path / "release")
    assert "SAVED" in output, output[-3000:]
    _assert_committed_intact(config, "run/contested", state(1.0))


def test_a_job_killed_mid_save_saves_the_same_id_again_with_default_settings(
    s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The resume path: the killed job's claim stays in the marker; its owner is provably gone (its owner lock
    on this host is free), so the restarted job takes the claim over (with a WARNING) and commits."""
    config = s3_server.config()
    child = _held_save(s3_server, config, tmp_path, "run/step_2", "data")
    child.kill()
    child.wait(30)
    if child.stdout:
        child.stdout.close()
    storage = config.create_storage()
    assert storage.exists(Path("run/step_2") / INCOMPLETE_MARKER)
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with sync_manager(config) as manager:
        manager.save("run/step_2", state(3.0))
    assert "took over" in caplog.text and "run/step_2" in caplog.text, caplog.text
    _assert_committed_intact(config, "run/step_2", state(3.0))


def _plant_claim(storage: FsspecStorage, checkpoint_id: str, created: float) -> None:
    """A claim by a job on another host (whose liveness this host cannot check), and one file of its save."""
    claim = {"token": ".x.tmp-0123456789ab-4", "uid": "0123456789ab", "host": "elsewhere", "pid": 1, "created": created}
    storage.write(Path(checkpoint_id) / INCOMPLETE_MARKER, json.dumps(claim).encode())
    storage.write(Path(checkpoint_id) / "model_0.pt", b"partial")


def test_a_recent_claim_whose_owner_cannot_be_checked_is_refused_saying_what_to_run(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    _plant_claim(storage, "run/step_5", time.time() - 60)
    url = storage.remap_path(Path("run/step_5"))
    with sync_manager(config) as manager:
        with pytest.raises(CommitError) as refused:
            manager.save("run/step_5", state(5.0))
        message = str(refused.value)
        assert url in message and "elsewhere" in message and f"aws s3 rm --recursive {url}/" in message, message
        assert storage.read(Path("run/step_5/model_0.pt")) == b"partial"  # the refused save deleted nothing
        storage.rmdir(Path("run/step_5"))  # what the message says to run
        manager.save("run/step_5", state(5.0))
    _assert_committed_intact(config, "run/step_5", state(5.0))


def test_a_claim_older_than_a_day_is_taken_over(s3_server: S3Server, caplog: pytest.LogCaptureFixture) -> None:
    config = s3_server.config()
    _plant_claim(config.create_storage(), "run/step_6", time.time() - DAY_S - 60)
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with sync_manager(config) as manager:
        manager.save("run/step_6", state(6.0))
    assert "took over" in caplog.text and "elsewhere" in caplog.text, caplog.text
    _assert_committed_intact(config, "run/step_6", state(6.0))


def test_a_claim_taken_over_before_the_commit_is_not_committed(s3_server: S3Server, tmp_path: Path) -> None:
    """The child pauses before its first data upload; its claim is replaced meanwhile (as a restarted job that
    judged it dead would). The child must not commit over the new owner, nor discard the new owner's claim: it
    re-checks its claim before the manifest."""
    config = s3_server.config()
    storage = config.create_storage()
    child = _held_save(s3_server, config, tmp_path, "run/step_7", "data")
    try:
        storage.delete(Path("run/step_7") / INCOMPLETE_MARKER)
        _plant_claim(storage, "run/step_7", time.time())
    finally:
        output = _finish(child, tmp_path / "release")
    assert "FAILED CommitError" in output and "run/step_7" in output and "elsewhere" in output, output[-3000:]
    assert not storage.exists(Path("run/step_7") / MANIFEST_FILE_NAME)
    marker = json.loads(storage.read(Path("run/step_7") / INCOMPLETE_MARKER))
    assert marker["host"] == "elsewhere"  # the new owner's claim, left to it


@pytest.mark.parametrize("store", ["s3", "memory"])
def test_the_conditional_primitives_refuse_a_changed_object(s3_server: S3Server, store: str) -> None:
    """What the claim stands on: create only if absent, replace and delete only the version read."""
    if store == "s3":
        storage = s3_server.config().create_storage()
    else:
        storage = FsspecStorage(FsspecStorageConfig(url=f"memory://claims-{time.monotonic_ns()}"))
    marker = Path("run/ck") / INCOMPLETE_MARKER
    assert storage.read_object(marker) is None
    assert storage.create_object(marker, b"first") and not storage.create_object(marker, b"second")
    found = storage.read_object(marker)
    assert found is not None and found[0] == b"first"
    if store == "s3":  # only S3 has versions to compare (the others replace and delete what is there)
        assert not storage.replace_object(marker, b"third", '"0123456789abcdef0123456789abcdef"')
        assert not storage.delete_object(marker, '"0123456789abcdef0123456789abcdef"')
        assert storage.read(marker) == b"first"
    assert storage.replace_object(marker, b"third", found[1])
    again = storage.read_object(marker)
    assert again is not None and again[0] == b"third"
    if store == "s3":
        assert not storage.replace_object(marker, b"fourth", found[1])  # the version read is gone
    assert storage.delete_object(marker, again[1]) and not storage.exists(marker)
    if store == "s3":
        assert not storage.replace_object(marker, b"fifth", again[1])  # nothing to replace: no claim is made
        assert not storage.exists(marker)
