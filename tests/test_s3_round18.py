"""Round 18 attacks on the object-store save and cleanup path, against a real S3 server (moto on loopback).

* A save that failed (a later upload refused, or its writer killed) cleaned up by deleting every object under
  the checkpoint's prefix: also the objects a user or another program PUT there while it ran (an eval job's
  results, a note), and an object a user PUT over one of the save's own keys. A failed save now removes only
  the objects its own saves wrote (each upload carries the save's claim token in its metadata; each delete is
  conditional on the ETag it was seen with) and logs at WARNING what it left in place. Checked on a prefix
  claimed fresh, on an id whose dead save's claim was taken over, and from the trainer after a killed writer.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.s3_faults import FaultProxy, HoldingS3FileSystem, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import REPO, fast_failing, run_with_slow_parts, state, sync_manager
from torch_checkpointing.commit import Claim
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

_WAIT_S = 120.0


def _dead_pid() -> int:
    """The pid of a process that has ended (a claim made by it is provably dead on this host)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    return int(done.stdout)


def _failing_save_with_user_puts(
    s3_server: S3Server,
    tmp_path: Path,
    ckpt: str,
    user: dict[str, bytes],
    also: tuple[Rule, ...] = (),
    before: Callable[[FsspecStorage], None] = lambda storage: None,
    while_held: Callable[[FsspecStorage], None] = lambda storage: None,
) -> tuple[FsspecStorage, BaseException]:
    """Save `ckpt`, PUT `user`'s objects (a plain client) while it waits to create its manifest, then make the
    store refuse that manifest (a real 500 through the proxy). Returns the plain storage and the save's error.

    `before` runs on the plain storage before the save starts (the fixture makes a fresh bucket per config, so
    this is the only way to write into the save's bucket), `while_held` once the save waits at its manifest."""
    config = s3_server.config()
    storage = config.create_storage()
    before(storage)
    held, release = tmp_path / "held", tmp_path / "release"
    port = s3_server.port
    failed: list[BaseException] = []
    with FaultProxy(port) as proxy:
        options = fast_failing(s3_server.storage_options(), proxy.endpoint)
        fs = HoldingS3FileSystem(**options, held_file=str(held), release_file=str(release), hold_on="manifest")
        saving = FsspecStorageConfig(url=config.url, part_size=config.part_size, filesystem=fs)

        def save() -> None:
            try:
                with sync_manager(saving) as manager:
                    manager.save(ckpt, state(1.0))
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=save)
        thread.start()
        try:
            deadline = time.monotonic() + _WAIT_S
            while not held.exists():
                assert thread.is_alive() and time.monotonic() < deadline, failed
                time.sleep(0.02)
            while_held(storage)
            for key, data in user.items():
                storage.write(Path(key), data)
            proxy.rules = [Rule(rf"^PUT \S*/{ckpt}/{MANIFEST_FILE_NAME}", 500, "InternalError"), *also]
        finally:
            release.touch()
            thread.join(timeout=_WAIT_S)
    assert len(failed) == 1 and isinstance(failed[0], CheckpointError), failed
    return storage, failed[0]


def _assert_only_users_left(storage: FsspecStorage, ckpt: str, user: dict[str, bytes], log: str) -> None:
    for key, data in user.items():
        assert storage.read(Path(key)) == data, key
        assert key in log, (key, log)
    left = sorted(str(Path(key).relative_to(ckpt)) for key in user)
    found = sorted(p.split(f"{ckpt}/", 1)[1] for p in storage.fs.find(f"{storage.config.url[5:]}/{ckpt}"))
    assert found == left, found  # the save's own files and its marker are gone, the user's are all there


def test_a_failed_save_on_a_fresh_prefix_removes_only_what_it_wrote(
    s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    ckpt = "run/step_1"
    user = {
        f"{ckpt}/eval/results.json": b'{"acc": 0.9}',  # an eval job writing beside the save
        f"{ckpt}/NOTES.txt": b"do not delete",
        f"{ckpt}/model_0.pt": b"the user's own bytes over one of the save's keys",
    }
    storage, _ = _failing_save_with_user_puts(s3_server, tmp_path, ckpt, user)
    _assert_only_users_left(storage, ckpt, user, caplog.text)
    assert "not written by this save" in caplog.text, caplog.text


def test_a_failed_save_over_a_dead_saves_id_removes_only_what_it_wrote(
    s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The id holds a killed save's claim (its process is gone): the new save takes it over, then fails."""
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    ckpt = "run/step_2"
    dead = Claim(token=".step_2.tmp-dead-1", uid="", host=os.uname().nodename, pid=_dead_pid(), created=time.time())
    user = {f"{ckpt}/eval/results.json": b'{"acc": 0.5}'}

    def taken_over(storage: FsspecStorage) -> None:
        taken = Claim.parse(storage.read(Path(ckpt) / INCOMPLETE_MARKER))
        assert taken is not None and taken.token != dead.token, taken

    storage, _ = _failing_save_with_user_puts(
        s3_server,
        tmp_path,
        ckpt,
        user,
        before=lambda storage: storage.write(Path(ckpt) / INCOMPLETE_MARKER, dead.to_bytes()),
        while_held=taken_over,
    )
    _assert_only_users_left(storage, ckpt, user, caplog.text)


KILLED_WRITER_CHILD = """
import json, os, signal, sys, time, torch
from pathlib import Path
from tests.s3_server import SlowPartsStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig
args = json.loads(sys.argv[1])
config = SlowPartsStorageConfig(**args["config"])
plain = FsspecStorageConfig(url=config.url, storage_options=config.storage_options).create_storage()
with CheckpointManager(CheckpointManager.Config(save=AsyncCheckpointSaverConfig(), storage_config=config)) as m:
    future = m.save(args["id"], {"model": {"w": torch.ones(3 * args["config"]["part_size"] // 4)}, "x": 1})
    deadline = time.monotonic() + 120
    while not Path(args["config"]["signal_file"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for key, data in args["user"].items():
        plain.write(Path(key), data.encode())
    os.kill(m.writer_pid, signal.SIGKILL)  # the writer dies with a multipart upload in flight
    try:
        future.result(timeout=120)
        print("KILLED SAVE COMMITTED", flush=True)
    except Exception as exc:
        print("KILLED SAVE FAILED", type(exc).__name__, flush=True)
"""


def test_the_trainers_cleanup_after_a_killed_writer_removes_only_what_the_save_wrote(
    s3_server: S3Server, tmp_path: Path
) -> None:
    config = s3_server.config()
    ckpt = f"run-{uuid.uuid4().hex[:6]}/step_1"
    user = {f"{ckpt}/eval/results.json": '{"acc": 0.7}', f"{ckpt}/NOTES.txt": "keep me"}
    args = {"id": ckpt, "user": user}
    returncode, output = run_with_slow_parts(KILLED_WRITER_CHILD, config, tmp_path / "part-uploaded", args)
    assert returncode == 0 and "KILLED SAVE FAILED" in output, output[-3000:]
    storage = config.create_storage()
    for key, data in user.items():
        assert storage.read(Path(key)) == data.encode(), (key, output[-3000:])
        assert key in output, output[-3000:]  # the WARNING names what was left in place
    found = sorted(p.split(f"{ckpt}/", 1)[1] for p in storage.fs.find(f"{config.url[5:]}/{ckpt}"))
    assert found == ["NOTES.txt", "eval/results.json"], found


# ------------------------------------------------------------------------------- gc of a killed save's prefix

_HELD_SAVE_CHILD = r"""
import json, sys, torch
from tests.s3_faults import HoldingS3FileSystem
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

a = json.loads(sys.argv[1])
fs = HoldingS3FileSystem(**a["options"], held_file=a["held"], release_file=a["release"], hold_on="manifest")
config = FsspecStorageConfig(url=a["url"], filesystem=fs, part_size=5 << 20)
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
    m.save(a["id"], {"model": {"w": torch.ones(8)}, "x": 1})
"""


def test_gc_of_a_killed_saves_prefix_removes_only_what_that_save_wrote(
    s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The whole trainer is killed mid-save (no cleanup at all): gc collects its prefix once its claim is dead,
    and deleted the objects a user PUT there while it ran along with it."""
    from torch_checkpointing.retention import collect_garbage

    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    config = s3_server.config()
    ckpt = "run/step_3"
    files = {k: str(tmp_path / k) for k in ("held", "release")}
    args = {"options": s3_server.storage_options(), "url": config.url, "id": ckpt, **files}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _HELD_SAVE_CHILD, json.dumps(args)], cwd=REPO, env=env)
    storage = config.create_storage()
    user = {f"{ckpt}/eval/results.json": b'{"acc": 0.3}', f"{ckpt}/NOTES.txt": b"keep me"}
    try:
        deadline = time.monotonic() + _WAIT_S
        while not Path(files["held"]).exists():  # its files are up; it is about to create its manifest
            assert child.poll() is None and time.monotonic() < deadline, child.returncode
            time.sleep(0.02)
        for key, data in user.items():
            storage.write(Path(key), data)
    finally:
        child.kill()
        child.wait(timeout=60)
    assert storage.exists(Path(ckpt) / INCOMPLETE_MARKER)  # killed: nothing cleaned up
    collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    _assert_only_users_left(storage, ckpt, user, caplog.text)


# ------------------------------------------------------------------------------- what retention's messages name


def test_retention_names_an_s3_checkpoint_by_its_url(s3_server: S3Server, caplog: pytest.LogCaptureFixture) -> None:
    """Retention's messages named `s3:/bucket/run/step_1` (a `Path` folds the URL's `//`): neither `aws s3` nor
    this library's CLI takes that back, and the message is the operator's only pointer to what to clean up."""
    from torch_checkpointing.retention import delete_checkpoint

    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    storage.write(Path("run/step_1/eval.json"), b"an eval job's result")
    assert not delete_checkpoint(f"{config.url}/run/step_1", storage)
    assert f"{config.url}/run/step_1 alone" in caplog.text, caplog.text
    assert "s3:/ckpt" not in caplog.text, caplog.text


# ------------------------------------------------------------------------------- a URL id that leaves its bucket


def test_a_url_id_whose_dots_leave_its_bucket_is_refused_naming_it(s3_server: S3Server) -> None:
    """`s3://a/../b/step_1` was normalised to `b/step_1`: the save wrote into another bucket than the one its id
    names, where retention and gc of `s3://a/...` never look (and a load read from there)."""
    from torch_checkpointing.errors import ConfigError

    config, other = s3_server.config(), s3_server.config()
    bucket, other_bucket = config.url[5:], other.url[5:]
    for crafted in (f"s3://{bucket}/../{other_bucket}/step_1", f"s3://{bucket}/run/../../{other_bucket}/step_1"):
        with sync_manager(config) as manager, pytest.raises(ConfigError) as refused:
            manager.save(crafted, state(1.0))
        said = str(refused.value)
        assert crafted in said and "'..'" in said and "drop the '..'" in said, said
    assert other.create_storage().fs.find(other_bucket) == []  # nothing reached the other bucket
    with sync_manager(config) as manager:  # '..' that stays inside the bucket names a key there, as before
        manager.save(f"s3://{bucket}/run/x/../step_2", state(2.0))
        assert float(manager.load(f"s3://{bucket}/run/step_2")["model"]["w"][0]) == 2.0


def test_a_cleanup_that_fails_names_the_prefix_and_the_gc_command_by_url(
    s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store refuses the failed save's DELETEs: the warning said `s3:/bucket/run/step_4` and `torch-checkpointing
    gc s3:/bucket/run`, a command that does not run."""
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    ckpt = "run/step_4"
    refuse = Rule(r"^DELETE ", 500, "InternalError")
    storage, _ = _failing_save_with_user_puts(s3_server, tmp_path, ckpt, {}, also=(refuse,))
    url = storage.config.url
    assert f"Could not remove the unfinished save at {url}/{ckpt}:" in caplog.text, caplog.text
    assert f"`torch-checkpointing gc {url}/run`" in caplog.text, caplog.text
