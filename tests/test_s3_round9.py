"""Object storage under attack, against a real local S3 server (moto on loopback, tests/s3_server.py).

* ids that are prefixes of one another (`step1`, `step10`, `step1-old`, `step1.x`, a root `r` beside `r-other`)
  and ids with spaces, '+', '%', unicode, '//' and a trailing slash: each checkpoint sees only its own objects;
* more than 1000 objects under one prefix: listing paginates, a delete of them all takes several requests;
* a store that answers a bulk delete with per-key errors (status 200, as S3 does when a bucket policy denies
  s3:DeleteObject), served by a real HTTP proxy in front of moto: the delete fails naming the kept objects;
* refusals that name their fix: a bucket that does not exist, denied access, an unknown access key;
* the server process SIGKILLed while a multipart upload is in flight, then restarted on the same port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import TEST_PART_SIZE, S3Server, SlowPartsStorageConfig, start_s3_server
from tests.test_s3_attacks import BOUND_S, fast_failing, state, sync_manager, through_proxy
from torch_checkpointing.discovery import latest_checkpoint, list_checkpoints
from torch_checkpointing.errors import CommitError, IncompleteCheckpointError, ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.retention import delete_checkpoint
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig


def _w(loaded: dict[str, Any]) -> float:
    return float(loaded["model"]["w"][0])


# ------------------------------------------------------------------------------------------ prefixes and names


def test_ids_that_prefix_one_another_never_see_or_delete_each_others_objects(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    ids = {"r/step1": 1.0, "r/step10": 10.0, "r/step1-old": 2.0, "r/step1.x": 3.0, "r-other/step1": 4.0}
    with sync_manager(config) as manager:
        for ckpt_id, seed in ids.items():
            manager.save(ckpt_id, state(seed))
        for ckpt_id, seed in ids.items():
            assert _w(manager.load(ckpt_id)) == seed, ckpt_id
        assert sorted(c.name for c in list_checkpoints(f"{config.url}/r", storage)) == [
            "step1",
            "step1-old",
            "step1.x",
            "step10",
        ]
        assert storage.ls(Path("r/step1")) == sorted(storage.ls(Path("r/step10")))  # the same files, each its own
        assert not storage.exists(Path("r/step"))  # a prefix of ids is no checkpoint, nor an object
        assert delete_checkpoint(f"{config.url}/r/step1", storage)
        assert not storage.exists(Path("r/step1"))
        for ckpt_id, seed in ids.items():
            if ckpt_id != "r/step1":
                assert _w(manager.load(ckpt_id)) == seed, ckpt_id
        with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
            manager.load("r/step1")
        storage.rmdir(Path("r/step1-old"))
        assert _w(manager.load("r/step1.x")) == 3.0 and _w(manager.load("r/step10")) == 10.0
        latest = latest_checkpoint(f"{config.url}/r", storage)
        assert latest is not None and latest.name in ("step10", "step1.x")
        assert _w(manager.load("r-other/step1")) == 4.0


def test_an_id_inside_another_checkpoints_prefix_is_refused_and_never_deleted_with_it(s3_server: S3Server) -> None:
    """`r/a/b` saved first: `r/a` is a prefix of it. Saving `r/a` would write over a prefix it does not own, and
    deleting `r/a` would take `r/a/b` along: both are refused, and `r/a/b` still loads."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("r/a/b", state(2.0))
        with pytest.raises(CommitError, match=r"r/a"):
            manager.save("r/a", state(1.0))
        assert not delete_checkpoint(f"{config.url}/r/a", storage)
        assert _w(manager.load("r/a/b")) == 2.0
        assert [c.name for c in list_checkpoints(f"{config.url}/r/a", storage)] == ["b"]
        assert list_checkpoints(f"{config.url}/r", storage) == []


ODD_IDS = ["odd/step 1", "odd/step+1", "odd/step%201", "odd/step%2B1", "odd/stüp€1"]


def test_ids_with_spaces_plus_percent_and_unicode_are_distinct_checkpoints(s3_server: S3Server) -> None:
    """moto (and some S3 gateways) once read '+' in a key as a space; '%20' must not be decoded either."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        for seed, ckpt_id in enumerate(ODD_IDS, start=1):
            manager.save(ckpt_id, state(float(seed)))
        for seed, ckpt_id in enumerate(ODD_IDS, start=1):
            assert _w(manager.load(ckpt_id)) == seed, ckpt_id
        names = sorted(c.name for c in list_checkpoints(f"{config.url}/odd", storage))
        assert names == sorted(i.split("/", 1)[1] for i in ODD_IDS)
        storage.rmdir(Path("odd/step 1"))
        for seed, ckpt_id in enumerate(ODD_IDS[1:], start=2):
            assert _w(manager.load(ckpt_id)) == seed, ckpt_id


def test_double_and_trailing_slashes_name_the_same_checkpoint(s3_server: S3Server) -> None:
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run//step_2/", state(2.0))
        assert _w(manager.load("run/step_2")) == 2.0
        assert _w(manager.load(f"{config.url}/run/step_2/")) == 2.0
    storage = config.create_storage()
    assert MANIFEST_FILE_NAME in storage.ls(Path("run/step_2"))
    assert storage.ls(Path("run")) == ["step_2"]  # no empty-named level from the '//'


# ------------------------------------------------------------------------------------------ scale


def _put_many(storage: FsspecStorage, prefix: str, n: int) -> list[str]:
    names = [f"{prefix}/{i:05d}.bin" for i in range(n)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda name: storage.write(Path(name), name.encode()), names))
    return names


def test_more_than_1000_objects_are_listed_and_deleted_whole(s3_server: S3Server) -> None:
    """Listing pages at 1000 keys, DeleteObjects takes 1000: a prefix of 2100 objects needs three of each."""
    storage = s3_server.config().create_storage()
    _put_many(storage, "big/ck", 2100)
    storage.write(Path("big/ck0/keep.bin"), b"neighbour")  # an id that the big one's name prefixes
    assert len(storage.ls(Path("big/ck"))) == 2100
    storage.rmdir(Path("big/ck"))
    assert not storage.exists(Path("big/ck")) and storage.ls(Path("big")) == ["ck0"]
    assert storage.read(Path("big/ck0/keep.bin")) == b"neighbour"


# ------------------------------------------------------------------------------------------ kept objects


class _DeleteDenyingProxy(FaultProxy):
    """Forwards every request to moto, except DeleteObjects: answered 200 with an AccessDenied error for each
    key, which is what S3 does when a bucket policy denies s3:DeleteObject to the caller."""

    def _answer(self, client: socket.socket, head: bytes, request_line: str) -> bool:
        if re.match(r"^POST \S*\?delete", request_line):
            client.sendall(_denied_deletes(client, head))
            return True
        return super()._answer(client, head, request_line)


def _denied_deletes(client: socket.socket, head: bytes) -> bytes:
    top, _, body = head.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", top).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += client.recv(1 << 16)
    errors = "".join(
        f"<Error><Key>{key}</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        for key in re.findall(r"<Key>(.*?)</Key>", body.decode())
    )
    xml = f'<?xml version="1.0" encoding="UTF-8"?><DeleteResult>{errors}</DeleteResult>'.encode()
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: {len(xml)}\r\nConnection: close\r\n\r\n"
    ).encode() + xml


def test_a_delete_the_store_refuses_per_key_fails_naming_the_objects_and_keeps_the_marker(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: s3fs dropped the per-key errors, rmdir removed the marker and returned: the files stayed, with
    nothing that marked them as a save's (gc could not find them) and no word said."""
    config = s3_server.config()
    port = s3_server.port
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
        manager.save("run/step_2", state(2.0))
    plain = config.create_storage()
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with _DeleteDenyingProxy(port) as proxy:
        denied = through_proxy(config, proxy).create_storage()
        start = time.monotonic()
        with pytest.raises(ObjectStoreError, match=r"run/step_1") as refused:
            denied.rmdir(Path("run/step_1"))
        assert time.monotonic() - start < BOUND_S
        message = str(refused.value)
        assert "AccessDenied" in message and "s3:DeleteObject" in message and "run/step_1/model_0.pt" in message
        assert message not in caplog.text  # raised: not told again as a WARNING
        with pytest.raises(ObjectStoreError, match=r"run/step_2") as kept:
            denied.rename(Path("run/step_2"), Path("run/.step_2.trash"), is_directory=True)
        assert "run/.step_2.trash" in str(kept.value)  # the copy that now exists beside it is named too
    # The refused delete left an unfinished save that readers refuse and gc can find, not anonymous files.
    assert INCOMPLETE_MARKER in plain.ls(Path("run/step_1"))
    with sync_manager(config) as manager, pytest.raises(IncompleteCheckpointError):
        manager.load("run/step_1")
    with sync_manager(config) as manager:
        assert _w(manager.load("run/step_2")) == 2.0  # the refused "rename" left the source whole
    plain.rmdir(Path("run/step_1"))  # the store lets us again: the delete completes
    assert not plain.exists(Path("run/step_1"))


# ------------------------------------------------------------------------------------------ refusals name the fix


def test_a_bucket_that_does_not_exist_is_an_error_that_says_to_create_it(s3_server: S3Server) -> None:
    options = s3_server.storage_options()
    config = FsspecStorageConfig(url="s3://no-such-bucket-r9/run", storage_options=options, part_size=TEST_PART_SIZE)
    with sync_manager(config) as manager, pytest.raises(ObjectStoreError) as refused:
        manager.save("step_1", state(1.0))
    message = str(refused.value)
    assert "s3://no-such-bucket-r9/run/step_1" in message and "NoSuchBucket" in message and "create it" in message


def test_lookups_in_a_bucket_that_does_not_exist_raise_instead_of_reporting_an_empty_run(s3_server: S3Server) -> None:
    """Before: s3fs answered a key of a missing bucket as a missing key, so `latest_checkpoint` was None and
    `list_checkpoints` empty (a resume on a misspelt bucket started from scratch), and a load said "no such
    directory"."""
    url = "s3://no-such-bucket-r9b/run"
    options = s3_server.storage_options()
    storage = FsspecStorageConfig(url=url, storage_options=options, part_size=TEST_PART_SIZE).create_storage()
    lookups = {
        "latest_checkpoint": lambda: latest_checkpoint(url, storage),
        "list_checkpoints": lambda: list_checkpoints(url, storage),
        "isdir": lambda: storage.isdir(Path("step_1")),
        "ls": lambda: storage.ls(Path("step_1")),
        "read": lambda: storage.read(Path("step_1") / MANIFEST_FILE_NAME),
        "getsize": lambda: storage.getsize(Path("step_1/model_0.pt")),
    }
    for name, lookup in lookups.items():
        with pytest.raises(ObjectStoreError, match=r"no-such-bucket-r9b") as refused:
            lookup()
        assert "does not exist" in str(refused.value) and "create it" in str(refused.value), name
    config = FsspecStorageConfig(url=url, storage_options=options, part_size=TEST_PART_SIZE)
    with sync_manager(config) as manager, pytest.raises(ObjectStoreError, match=r"no-such-bucket-r9b"):
        manager.load("step_1")


def test_a_miss_in_a_bucket_that_exists_stays_a_miss_and_checks_the_bucket_once(s3_server: S3Server) -> None:
    config = s3_server.config()
    port = s3_server.port
    with FaultProxy(port) as proxy:
        storage = through_proxy(config, proxy).create_storage()
        assert latest_checkpoint(f"{config.url}/run", storage) is None
        assert not storage.exists(Path("run/step_1")) and not storage.isdir(Path("run/step_1"))
        with pytest.raises(FileNotFoundError):
            storage.read(Path("run/step_1/manifest.json"))
        bucket = config.url.split("://", 1)[1]
        assert sum(line.startswith(f"HEAD /{bucket} ") for line in proxy.seen) == 1, proxy.seen


@pytest.mark.parametrize(
    ("code", "fix"), [("AccessDenied", "s3:PutObject"), ("InvalidAccessKeyId", "AWS_ACCESS_KEY_ID")]
)
def test_refused_credentials_name_the_fix_and_the_earlier_checkpoint_stays(
    s3_server: S3Server, code: str, fix: str
) -> None:
    config = s3_server.config()
    port = s3_server.port
    with FaultProxy(port) as proxy, sync_manager(through_proxy(config, proxy)) as manager:
        manager.save("run/step_1", state(1.0))
        proxy.rules = [Rule(r"^(PUT|POST) ", 403, code)]
        with pytest.raises(ObjectStoreError, match=r"run/step_2") as refused:
            manager.save("run/step_2", state(2.0))
        assert code in str(refused.value) and fix in str(refused.value)
        proxy.rules = []
        assert _w(manager.load("run/step_1")) == 1.0
        with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
            manager.load("run/step_2")
        torch.testing.assert_close(manager.load("run/step_1")["model"]["w"], state(1.0)["model"]["w"])


@pytest.mark.parametrize(
    "rule",
    [
        Rule(r"^PUT \S*/run/step_2/model_0\.pt\?partNumber=2", 500, "InternalError"),  # one part of a multipart
        Rule(r"^PUT \S*/run/step_2/model_0\.pt\?partNumber=3", 503, "SlowDown"),
        Rule(r"^HEAD \S*/run/step_2/model_0\.pt ", 500, "InternalError"),  # uploaded, then the commit's HEAD fails
        Rule(r"^GET \S*\?list-type=2&prefix=run%2Fstep_2%2F&", 503, "ServiceUnavailable"),  # a listing of the save
    ],
    ids=["part-500", "part-503", "head-after-put", "listing"],
)
def test_one_failing_request_of_a_save_fails_it_naming_the_object_and_leaves_nothing_loadable(
    s3_server: S3Server, rule: Rule, caplog: pytest.LogCaptureFixture
) -> None:
    config = s3_server.config()
    port = s3_server.port
    bucket = config.url.split("://", 1)[1]
    plain = config.create_storage()
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with FaultProxy(port) as proxy, sync_manager(through_proxy(config, proxy)) as manager:
        manager.save("run/step_1", state(1.0))
        proxy.rules = [rule]
        with pytest.raises(ObjectStoreError, match=r"run/step_2") as failed:
            manager.save("run/step_2", state(2.0, n=TEST_PART_SIZE))  # 4 parts of 5 MiB
        # Raised, and not told again as the storage's WARNING (the save's own report line may name it).
        assert str(failed.value) not in [r.getMessage() for r in caplog.records]
        hit = [line for line in proxy.seen if rule.matches(line)]
        proxy.rules = []
        if not hit:
            pytest.fail(f"the save never sent the request {rule.pattern}: {proxy.seen}")
        with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
            manager.load("run/step_2")
        assert _w(manager.load("run/step_1")) == 1.0
    assert not plain.exists(Path("run/step_2") / MANIFEST_FILE_NAME)
    assert not plain.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")  # every upload aborted


# ------------------------------------------------------------------------------------------ a server killed mid-save


def _restart_on(port: int, log_dir: Path) -> subprocess.Popen[bytes]:
    """A new moto process on the port of one that was killed (its objects died with it: moto keeps no disk)."""
    with open(log_dir / "moto-restarted.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return process
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"moto did not restart on port {port} (exit code {process.poll()})")


def test_a_server_killed_mid_upload_fails_the_save_naming_the_object_and_a_restarted_one_takes_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL of the server process while a multipart upload is in flight: the save fails within the bound with
    an ObjectStoreError naming the object (and logged); after a restart the same manager saves and loads."""
    server = start_s3_server(os.fspath(tmp_path))
    restarted: subprocess.Popen[bytes] | None = None
    try:
        bucket = server.config().url.split("://", 1)[1]
        signal_file = tmp_path / "part-up"
        config = SlowPartsStorageConfig(
            url=f"s3://{bucket}",
            storage_options=fast_failing(server.storage_options()),
            part_size=TEST_PART_SIZE,
            signal_file=os.fspath(signal_file),
            part_delay_s=0.5,
        )
        caplog.set_level(logging.WARNING, logger="torch_checkpointing")
        with sync_manager(config) as manager:
            killer = threading.Thread(target=_kill_when, args=(signal_file, server.process), daemon=True)
            killer.start()
            start = time.monotonic()
            with pytest.raises(ObjectStoreError, match=rf"s3://{bucket}/run/step_1/model_0\.pt") as failed:
                manager.save("run/step_1", state(1.0, n=TEST_PART_SIZE))  # 4 parts: the kill lands mid-upload
            assert time.monotonic() - start < BOUND_S
            killer.join(10)
            assert str(failed.value) in caplog.text
            restarted = _restart_on(server.port, tmp_path)
            server.make_bucket(bucket)
            signal_file.unlink()
            manager.save("run/step_2", state(2.0))
            assert _w(manager.load("run/step_2")) == 2.0
            with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
                manager.load("run/step_1")
    finally:
        server.stop()
        if restarted is not None:
            restarted.terminate()
            restarted.wait(10)


def _kill_when(signal_file: Path, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + BOUND_S
    while not signal_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    process.kill()
    process.wait(10)
