"""Attacks on checkpoints in object storage, against a real S3 server (moto on loopback) and real processes.

What a user or an attacker can do to a store: replace an object while it is read, truncate it, put a prefix
where an object should be, commit the same id from two processes at once, kill the async writer mid-upload,
craft a manifest whose paths leave the checkpoint, stop the server, answer 5xx, or stop answering. Each test
says what must hold: a named error (`ObjectStoreError` naming the URL, `CorruptCheckpointError` /
`UnsafeCheckpointError` naming the file), never wrong data, never a commit that was lost silently, every wait
bounded by the configured timeouts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_faults import FaultProxy, ReplacingS3FileSystem, Rule
from tests.s3_server import TEST_PART_SIZE, S3Server, start_s3_server
from torch_checkpointing import CheckpointManager, latest_checkpoint, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ObjectStoreError,
    UnsafeCheckpointError,
)
from torch_checkpointing.manifest import MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

REPO = Path(__file__).resolve().parent.parent
# Bounded client: each request gives up after a few seconds, botocore retries once (s3fs adds its own retries).
FAST_FAIL = {"connect_timeout": 2, "read_timeout": 2, "retries": {"max_attempts": 2, "mode": "standard"}}
BOUND_S = 60.0  # no failure below may take longer to surface


def fast_failing(options: dict[str, Any], endpoint: str | None = None) -> dict[str, Any]:
    out = {**options, "config_kwargs": FAST_FAIL}
    if endpoint is not None:
        out["endpoint_url"] = endpoint
    return out


def through_proxy(config: FsspecStorageConfig, proxy: FaultProxy, **extra: Any) -> FsspecStorageConfig:
    """`config`'s bucket reached through the fault proxy, failing fast."""
    options = fast_failing(config.storage_options, proxy.endpoint)
    return FsspecStorageConfig(url=config.url, part_size=config.part_size, storage_options=options, **extra)


def sync_manager(config: FsspecStorageConfig) -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config))


def state(seed: float, n: int = 1000) -> dict[str, Any]:
    return {"model": {"w": torch.full((n,), float(seed))}, "meta": {"seed": seed}}


def checkpoint_names(storage: Any, root: str) -> list[str]:
    """The names of the committed checkpoints under `root`, as `list_checkpoints` orders them."""
    return [c.name for c in list_checkpoints(root, storage)]


def two_saved(s3_server: S3Server) -> tuple[FsspecStorageConfig, int, Any, str]:
    """run/step_1 (of `state(1.0)`) and run/step_2 (2.0) saved on a new bucket of `s3_server`: its config, the
    server's port (for a FaultProxy in front of it), a storage on it, and the run's URL (a retention root)."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
        manager.save("run/step_2", state(2.0))
    return config, s3_server.port, config.create_storage(), f"{config.url}/run"


@pytest.fixture
def storage(s3_server: S3Server) -> FsspecStorage:
    return s3_server.config().create_storage()


@pytest.fixture
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A server of this test alone: the test may stop, pause or kill it."""
    server = start_s3_server(str(tmp_path_factory.mktemp("moto-own")))
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            server.process.send_signal(signal.SIGCONT)
        server.stop()


def _named_store_error(exc: BaseException, url: str) -> None:
    assert isinstance(exc, ObjectStoreError), f"{type(exc).__name__}: {exc}"
    assert url in str(exc), str(exc)


# ------------------------------------------------------------------------------------- reads see one version


def test_a_read_after_a_listing_returns_the_objects_current_bytes(storage: FsspecStorage) -> None:
    """fsspec caches listings; a read sized from that cache after another process replaced the object
    returned the old size's worth of the new bytes (silently truncated)."""
    storage.write(Path("run/a.bin"), b"x" * 100)
    assert storage.ls(Path("run")) == ["a.bin"]  # fills the listing cache
    other = FsspecStorage(storage.config)  # another process's view of the same store
    other.write(Path("run/a.bin"), b"y" * 300)
    assert storage.read(Path("run/a.bin")) == b"y" * 300


def test_a_range_past_the_objects_end_is_an_error_naming_it(storage: FsspecStorage) -> None:
    """A short answer used to come back as if it were the range (only long, multi-GET ranges were checked)."""
    storage.write(Path("run/short.bin"), b"z" * 100)
    url = storage.remap_path(Path("run/short.bin"))
    with pytest.raises(ObjectStoreError, match="shorter") as caught:
        storage.read_range(Path("run/short.bin"), 50, 100)
    _named_store_error(caught.value, url)
    assert storage.read_range(Path("run/short.bin"), 50, 50) == b"z" * 50


@pytest.mark.parametrize("ranged", [False, True], ids=["read", "read_range"])
def test_an_object_replaced_between_the_gets_of_one_read_is_refused(s3_server: S3Server, ranged: bool) -> None:
    """A long read is several GETs; an object replaced between them used to come back as a splice of two
    versions that no writer ever wrote."""
    config = s3_server.config(max_concurrency=1)
    storage = config.create_storage()
    size = 2 * TEST_PART_SIZE + 10
    storage.write(Path("run/big.bin"), b"a" * size)
    victim = storage.remap_path(Path("run/big.bin")).split("://", 1)[1]
    replacing = ReplacingS3FileSystem(**s3_server.storage_options(), victim=victim, replacement=b"b" * size)
    attacked = FsspecStorage(FsspecStorageConfig(**{**vars(config), "filesystem": replacing}))
    with pytest.raises(ObjectStoreError, match="changed while it was read") as caught:
        if ranged:
            attacked.read_range(Path("run/big.bin"), 5, size - 10)
        else:
            attacked.read(Path("run/big.bin"))
    assert replacing.replaced
    _named_store_error(caught.value, f"s3://{victim}")
    assert attacked.read(Path("run/big.bin")) == b"b" * size  # the next read sees the new version whole


def test_a_prefix_is_not_read_as_an_empty_object(storage: FsspecStorage) -> None:
    """A "directory" (a prefix with objects under it) used to read as zero bytes of data."""
    storage.write(Path("run/model.pt/inner"), b"data")
    url = storage.remap_path(Path("run/model.pt"))
    with pytest.raises(ObjectStoreError, match="prefix") as caught:
        storage.read(Path("run/model.pt"))
    _named_store_error(caught.value, url)


# ------------------------------------------------------------------------------------- crafted checkpoints


def _copy_checkpoint(storage: FsspecStorage, src: str, dst: str, manifest: dict[str, Any] | None = None) -> None:
    for name in storage.ls(Path(src)):
        if name != MANIFEST_FILE_NAME:
            storage.write(Path(dst) / name, storage.read(Path(src) / name))
    text = json.dumps(manifest) if manifest is not None else storage.read(Path(src) / MANIFEST_FILE_NAME).decode()
    storage.write(Path(dst) / MANIFEST_FILE_NAME, text.encode())


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("../victim/model_0.pt", UnsafeCheckpointError),
        ("sub//../../victim/model_0.pt", UnsafeCheckpointError),
        ("/run/victim/model_0.pt", UnsafeCheckpointError),
        ("s3://{bucket}/run/victim/model_0.pt", CorruptCheckpointError),  # a key inside the prefix: missing
        ("..%2fvictim%2fmodel_0.pt", CorruptCheckpointError),  # a literal key inside the prefix: missing
    ],
)
def test_a_manifest_naming_keys_outside_its_prefix_never_reads_them(
    s3_server: S3Server, path: str, error: type[Exception]
) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/victim", state(7.0))
        manager.save("run/base", state(1.0))
        manifest = json.loads(storage.read(Path("run/base") / MANIFEST_FILE_NAME))
        manifest["items"]["model"]["0"]["path"] = path.format(bucket=config.url.split("://", 1)[1])
        _copy_checkpoint(storage, "run/base", "run/crafted", manifest)
        with pytest.raises(error) as caught:
            manager.load("run/crafted")
    assert "run/crafted" in str(caught.value)


def test_an_object_resized_or_replaced_by_a_prefix_after_the_commit_is_refused_naming_it(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/base", state(1.0))
        for name, damage in [
            ("empty", lambda p: storage.write(p, b"")),
            ("longer", lambda p: storage.write(p, storage.read(Path("run/base/model_0.pt")) + b"\0")),
            ("prefix", lambda p: (storage.delete(p), storage.write(p / "x", b"x"))),
        ]:
            _copy_checkpoint(storage, "run/base", f"run/{name}")
            damage(Path(f"run/{name}/model_0.pt"))
            with pytest.raises(CorruptCheckpointError, match=rf"run/{name}/model_0\.pt"):
                manager.load(f"run/{name}")
        assert torch.equal(manager.load("run/base")["model"]["w"], state(1.0)["model"]["w"])


# ------------------------------------------------------------------------------------- two commits of one id


def test_a_manifest_already_in_the_store_is_never_replaced(storage: FsspecStorage) -> None:
    """On a store without rename the manifest's appearance is the commit: a second one used to replace the
    first silently, and the save that wrote the first was told it had committed."""
    storage.write(Path("run/ck") / MANIFEST_FILE_NAME, b'{"first": 1}')
    url = storage.remap_path(Path("run/ck") / MANIFEST_FILE_NAME)
    with pytest.raises(ObjectStoreError, match="already exists") as caught:
        FsspecStorage(storage.config).write(Path("run/ck") / MANIFEST_FILE_NAME, b'{"second": 2}')
    _named_store_error(caught.value, url)
    # A manifest larger than a part goes through the multipart writer: the same rule.
    with pytest.raises(ObjectStoreError, match="already exists"):
        storage.write(Path("run/ck") / MANIFEST_FILE_NAME, b" " * (TEST_PART_SIZE + 1))
    assert storage.read(Path("run/ck") / MANIFEST_FILE_NAME) == b'{"first": 1}'
    storage.write(Path("run/ck/model_0.pt"), b"1")
    storage.write(Path("run/ck/model_0.pt"), b"2")  # other objects are replaced as before
    assert storage.read(Path("run/ck/model_0.pt")) == b"2"


HOLDING_CHILD = """
import json, sys, torch
from tests.s3_faults import HoldingS3FileSystem
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig
args = json.loads(sys.argv[1])
hold = {"held_file": args["held"], "release_file": args["release"], "hold_on": args["hold_on"]}
fs = HoldingS3FileSystem(**args["options"], **hold)
config = FsspecStorageConfig(url=args["url"], part_size=args["part_size"], filesystem=fs)
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
    try:
        m.save(args["id"], {"model": {"w": torch.full((1000,), 1.0)}, "meta": {"seed": 1.0}})
        print("SAVED", flush=True)
    except Exception as exc:
        print("FAILED", type(exc).__name__, exc, flush=True)
"""


def _held_save(
    s3_server: S3Server, config: FsspecStorageConfig, tmp_path: Path, checkpoint_id: str, hold_on: str
) -> subprocess.Popen[bytes]:
    """A process saving `checkpoint_id` under `config`, paused in its commit (`HoldingS3FileSystem`) until
    `tmp_path/release` exists; returned once it is paused (its output on a pipe)."""
    held = tmp_path / "held"
    args = {
        "options": s3_server.storage_options(),
        "url": config.url,
        "part_size": config.part_size,
        "id": checkpoint_id,
        "held": str(held),
        "release": str(tmp_path / "release"),
        "hold_on": hold_on,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDING_CHILD, json.dumps(args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while not held.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not held.exists():
        child.kill()
        output = child.communicate(timeout=30)[0].decode(errors="replace")
        pytest.fail(f"the save never reached the held step of its commit ({hold_on}):\n{output[-3000:]}")
    return child


def test_two_processes_committing_one_id_leave_exactly_one_checkpoint_that_loads(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Process A passes every check of its commit, then pauses; process B saves the same id. A's manifest used to
    land over B's: both reported success, and A's manifest described B's bytes. Then (with the conditional
    manifest) A failed, but only after B's data uploads had replaced A's. A holds the id's claim from its first
    write: B is refused before it writes anything, and A commits (tests/test_s3_claims.py has the other orders)."""
    config = s3_server.config()
    release = tmp_path / "release"
    child = _held_save(s3_server, config, tmp_path, "run/contested", "manifest")
    try:
        with sync_manager(config) as manager:
            with pytest.raises(CommitError, match="another save is writing it"):
                manager.save("run/contested", state(2.0))
            release.touch()
            output = child.communicate(timeout=120)[0].decode(errors="replace")
            assert "SAVED" in output, output[-3000:]
            got = manager.load("run/contested")
        assert torch.equal(got["model"]["w"], state(1.0)["model"]["w"]) and got["meta"] == {"seed": 1.0}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        if child.stdout:
            child.stdout.close()


# ------------------------------------------------------------------------------------- the server fails


def test_a_store_that_stopped_fails_listings_and_loads_with_an_error_naming_the_url(
    own_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Lookups and listings used to raise the HTTP client's own error (no URL of ours, not a CheckpointError);
    `list_checkpoints` must not read an unreachable store as an empty run either."""
    config = own_server.config()
    config = FsspecStorageConfig(
        url=config.url, part_size=config.part_size, storage_options=fast_failing(config.storage_options)
    )
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
        own_server.process.kill()
        own_server.process.wait(10)
        caplog.set_level(logging.WARNING, logger="torch_checkpointing")
        calls = {
            "list_checkpoints": lambda: list_checkpoints(f"{config.url}/run", storage),
            "latest_checkpoint": lambda: latest_checkpoint(f"{config.url}/run", storage),
            "load": lambda: manager.load("run/step_1"),
            "exists": lambda: storage.exists(Path("run/step_1") / MANIFEST_FILE_NAME),
            "getsize": lambda: storage.getsize(Path("run/step_1/model_0.pt")),
        }
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(ObjectStoreError, match=config.url.split("://", 1)[1]) as caught:
                call()
            assert time.monotonic() - start < BOUND_S, name
            assert str(caught.value) not in caplog.text, name  # raised: not told again as a WARNING


def test_5xx_answers_fail_the_save_and_the_load_naming_the_url_and_commit_nothing(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    config = s3_server.config()
    port = s3_server.port
    with FaultProxy(port) as proxy:
        through = through_proxy(config, proxy)
        storage = config.create_storage()
        caplog.set_level(logging.WARNING, logger="torch_checkpointing")
        with sync_manager(through) as manager:
            manager.save("run/step_1", state(1.0))
            # The commit itself (the manifest PUT) fails: nothing is committed, the earlier checkpoint stays.
            proxy.rules = [Rule(r"^PUT \S*/run/step_2/manifest\.json", 500, "InternalError")]
            with pytest.raises(CheckpointError, match=r"run/step_2/manifest\.json") as caught:
                manager.save("run/step_2", state(2.0))
            assert "ObjectStoreError" in f"{type(caught.value).__name__}: {caught.value}"
            assert not storage.exists(Path("run/step_2") / MANIFEST_FILE_NAME)
            with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):  # the failed save was discarded
                manager.load("run/step_2")
            assert [c.name for c in list_checkpoints(f"{config.url}/run", storage)] == ["step_1"]
            # Every GET and HEAD answers 503 (a store shedding load): the load fails naming the object.
            proxy.rules = [Rule(r"^(GET|HEAD) ", 503, "ServiceUnavailable")]
            start = time.monotonic()
            with pytest.raises(ObjectStoreError, match=r"run/step_1") as refused:
                manager.load("run/step_1")
            assert time.monotonic() - start < BOUND_S
            assert "injected by the test proxy" in str(refused.value)
            assert str(refused.value) not in caplog.text  # raised: not told again as a WARNING
            proxy.rules = []
            manager.save("run/step_3", state(3.0))  # the store answers again: the next save simply works
            assert torch.equal(manager.load("run/step_3")["model"]["w"], state(3.0)["model"]["w"])


@pytest.mark.parametrize("phase", ["save", "load"])
def test_a_server_that_stops_answering_is_bounded_by_the_configured_timeouts(s3_server: S3Server, phase: str) -> None:
    """The connection is accepted and then neither read nor answered (a stopped server, a black-holed route).
    An upload blocked sending its body used to wait forever: the client's read timeout does not cover it.
    `request_timeout_s` ends each request; the save commits nothing; the manager stays usable."""
    config = s3_server.config()
    port = s3_server.port
    payload = state(1.0, n=TEST_PART_SIZE // 2)  # two parts: the hang lands mid multipart upload / mid read
    with FaultProxy(port) as proxy:
        through = through_proxy(config, proxy, request_timeout_s=5.0)
        storage = config.create_storage()
        with sync_manager(through) as manager:
            if phase == "load":
                manager.save("run/hung", payload)
                proxy.rules = [Rule(r"^GET \S*/run/hung/model_0\.pt", 0)]
            else:
                proxy.rules = [Rule(r"^PUT \S*/run/hung/model_0\.pt\?\S*partNumber=2", 0)]
            start = time.monotonic()
            with pytest.raises(ObjectStoreError, match=r"run/hung/model_0\.pt"):
                if phase == "load":
                    manager.load("run/hung")
                else:
                    manager.save("run/hung", payload)
            assert time.monotonic() - start < BOUND_S
            proxy.rules = []
            if phase == "save":
                assert not storage.exists(Path("run/hung") / MANIFEST_FILE_NAME)
                assert not storage.exists(Path("run/hung/model_0.pt"))  # the multipart upload never completed
            manager.save("run/after", state(5.0))
            assert torch.equal(manager.load("run/after")["model"]["w"], state(5.0)["model"]["w"])


def test_missing_credentials_fail_the_save_with_an_error_naming_the_url(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key in the options, the environment or a config file: the first lookup used to raise botocore's
    NoCredentialsError itself."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role probe
    bucket = s3_server.config().url
    options = {"endpoint_url": s3_server.endpoint, "skip_instance_cache": True, "config_kwargs": FAST_FAIL}
    config = FsspecStorageConfig(url=bucket, part_size=TEST_PART_SIZE, storage_options=options)
    with sync_manager(config) as manager:
        start = time.monotonic()
        with pytest.raises(ObjectStoreError, match="(?i)credentials") as caught:
            manager.save("run/step_1", state(1.0))
        assert time.monotonic() - start < BOUND_S
    assert f"{bucket}/run/step_1" in str(caught.value)
    assert not s3_server.config(bucket=bucket.split("://", 1)[1]).create_storage().exists(Path("run/step_1"))


# ------------------------------------------------------------------------------------- a killed async writer

KILLED_WRITER_CHILD = """
import json, os, signal, sys, time, torch
from pathlib import Path
from tests.s3_server import SlowPartsStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig
args = json.loads(sys.argv[1])
config = SlowPartsStorageConfig(**args["config"])
with CheckpointManager(CheckpointManager.Config(save=AsyncCheckpointSaverConfig(), storage_config=config)) as m:
    m.save(args["earlier"], {"model": {"w": torch.zeros(4)}}).result(timeout=120)
    future = m.save(args["id"], {"model": {"w": torch.ones(3 * args["config"]["part_size"] // 4)}})
    deadline = time.monotonic() + 120
    while not Path(args["config"]["signal_file"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(m.writer_pid, signal.SIGKILL)  # the writer dies with a multipart upload in flight
    try:
        future.result(timeout=120)
        print("KILLED SAVE COMMITTED", flush=True)
    except Exception as exc:
        print("KILLED SAVE FAILED", type(exc).__name__, flush=True)
    m.save(args["fresh"], {"model": {"w": torch.full((4,), 2.0)}}).result(timeout=120)
    print("FRESH SAVED", flush=True)
"""


def run_with_slow_parts(
    script: str, config: FsspecStorageConfig, signal_file: Path, args: dict[str, Any]
) -> tuple[int, str]:
    """Run `script` in a child (`python -c script ARGS`); ARGS is `args` plus, under "config", the fields of a
    `SlowPartsStorageConfig` on `config`'s bucket whose parts each take 30 s and which touches `signal_file`
    once the first is up. Returns the child's exit status and its output (stdout then stderr)."""
    slow = {
        "url": config.url,
        "storage_options": config.storage_options,
        "part_size": config.part_size,
        "signal_file": str(signal_file),
        "part_delay_s": 30.0,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps({**args, "config": slow})],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=300,
    )
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


def test_a_writer_killed_mid_upload_commits_nothing_and_the_next_save_works(
    s3_server: S3Server, tmp_path: Path
) -> None:
    config = s3_server.config()
    run = f"{config.url}/run-{uuid.uuid4().hex[:6]}"
    ids = {"earlier": f"{run}/step_1", "id": f"{run}/step_2", "fresh": f"{run}/step_3"}
    returncode, output = run_with_slow_parts(KILLED_WRITER_CHILD, config, tmp_path / "part-uploaded", ids)
    assert returncode == 0 and "KILLED SAVE FAILED" in output and "FRESH SAVED" in output, output[-3000:]
    storage = config.create_storage()
    assert [c.name for c in list_checkpoints(run, storage)] == ["step_1", "step_3"]
    latest = latest_checkpoint(run, storage)
    assert latest is not None and latest.name == "step_3"
    assert not storage.exists(Path(f"{run}/step_2") / MANIFEST_FILE_NAME)
    assert not storage.exists(Path(f"{run}/step_2/model_0.pt"))  # the multipart upload never completed
    with sync_manager(config) as manager, pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
        manager.load(f"{run}/step_2")
    # The trainer saw its writer die and discarded the prefix, or left it marked: never an unmarked leftover.
    leftovers = [(Path(o.path).name, o.kind) for o in list_leftovers(run, storage)]
    assert leftovers in ([], [("step_2", "incomplete")]), leftovers
    if not leftovers:  # discarded under its claim: the upload its killed writer had under way went with it
        bucket, prefix, _ = storage.fs.split_path(f"{run}/")
        assert not storage.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads")


def test_a_commit_killed_before_its_marker_is_removed_is_incomplete_and_recognised(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The marker goes last: a save killed between its manifest and the marker's removal leaves both, which a
    load refuses as incomplete, `latest_checkpoint` skips, and gc lists as an unfinished save of ours. With the
    marker removed first, the same kill left a manifest-less, marker-less prefix that nothing recognised."""
    from torch_checkpointing.discovery import latest_checkpoint, list_leftovers
    from torch_checkpointing.errors import IncompleteCheckpointError

    config = s3_server.config()
    child = _held_save(s3_server, config, tmp_path, "run/killed", "marker")
    child.kill()
    child.wait(30)
    storage = config.create_storage()
    assert storage.exists(Path("run/killed/manifest.json"))  # the kill landed after the manifest
    with sync_manager(config) as manager, pytest.raises(IncompleteCheckpointError):
        manager.load("run/killed")
    assert latest_checkpoint("run", storage) is None
    assert [(Path(lo.path).name, lo.kind, lo.recognised) for lo in list_leftovers("run", storage)] == [
        ("killed", "incomplete", True)
    ]
