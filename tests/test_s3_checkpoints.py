"""Checkpoints on S3 (a real moto server on loopback): sync and async round trips of every format, the
commit-file rule (manifest last, overwrite refused, a prefix without a manifest is incomplete), verification,
a failed upload, and a save killed mid-upload (real processes, SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_server import TEST_PART_SIZE, S3Server
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
)
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

REPO = Path(__file__).resolve().parent.parent
ITEMS = {
    "model": ItemSpec(),  # the default layout: model_{rank}.pt, torch.save
    "meta": ItemSpec(requires_copy=False, layout=LayoutInfo("meta_{rank}.json", JsonSerialization())),
    "blob": ItemSpec(requires_copy=False, layout=LayoutInfo("blob_{rank}.bin", RawSerialization())),
    "weights": ItemSpec(layout=LayoutInfo("weights/{rank}.safetensors", SafetensorsSerialization())),
}


def payload(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(TEST_PART_SIZE // 2, generator=gen), "step": seed},  # 2 parts: multipart
        "meta": {"step": seed, "note": "s3"},
        "blob": bytes([seed % 256]) * 1000,
        "weights": {"a": torch.randn(8, 8, generator=gen), "b": {"c": torch.arange(5)}},
    }


def templates() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(TEST_PART_SIZE // 2), "step": 0},
        "meta": None,
        "blob": None,
        "weights": {"a": torch.zeros(8, 8), "b": {"c": torch.zeros(5, dtype=torch.int64)}},
    }


def assert_round_trip(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and got["model"]["step"] == want["model"]["step"]
    assert got["meta"] == want["meta"]
    assert got["blob"] == want["blob"] and isinstance(got["blob"], bytes)
    assert torch.equal(got["weights"]["a"], want["weights"]["a"])
    assert torch.equal(got["weights"]["b"]["c"], want["weights"]["b"]["c"])


def manager(config: FsspecStorageConfig, async_save: bool = False) -> CheckpointManager:
    save = AsyncCheckpointSaverConfig() if async_save else SyncCheckpointSaverConfig()
    return CheckpointManager(CheckpointManager.Config(items=ITEMS, save=save, storage_config=config))


@pytest.fixture(scope="module")
def bucket_config(s3_server: S3Server) -> FsspecStorageConfig:
    return s3_server.config()


@pytest.fixture(scope="module")
def sync_s3(bucket_config: FsspecStorageConfig) -> Iterator[CheckpointManager]:
    with manager(bucket_config) as m:
        yield m


@pytest.fixture(scope="module")
def async_s3(bucket_config: FsspecStorageConfig) -> Iterator[CheckpointManager]:
    with manager(bucket_config, async_save=True) as m:
        yield m


@pytest.fixture
def storage(bucket_config: FsspecStorageConfig) -> FsspecStorage:
    return bucket_config.create_storage()


def objects(storage: FsspecStorage, prefix: str) -> list[str]:
    """Every object under a prefix, relative to it (a listing, no cache)."""
    root = storage.remap_path(Path(prefix)).split("://", 1)[1]  # bucket/key, as the listing names objects
    storage.fs.invalidate_cache()
    return sorted(k[len(root) + 1 :] for k in storage.fs.find(root) if k.startswith(root + "/"))


# ------------------------------------------------------------------------------------------ round trips


def test_sync_round_trip_of_every_format(sync_s3: CheckpointManager, storage: FsspecStorage) -> None:
    want = payload(1)
    assert sync_s3.save("runs/sync/step_1", want) is None
    assert objects(storage, "runs/sync/step_1") == [
        "blob_0.bin",
        MANIFEST_FILE_NAME,
        "meta_0.json",
        "model_0.pt",
        "weights/0.safetensors",
    ]
    assert_round_trip(dict(sync_s3.load("runs/sync/step_1", into=templates())), want)


def test_full_url_ids_and_relative_ids_name_the_same_checkpoint(
    sync_s3: CheckpointManager, bucket_config: FsspecStorageConfig
) -> None:
    want = payload(2)
    sync_s3.save(f"{bucket_config.url}/runs/url/step_2", want)
    assert_round_trip(dict(sync_s3.load("runs/url/step_2", into=templates())), want)


def test_async_round_trip_of_every_format(async_s3: CheckpointManager, storage: FsspecStorage) -> None:
    want = payload(3)
    future = async_s3.save("runs/async/step_3", want)
    assert future is not None
    future.result(timeout=120)
    # The write Future resolves only once the manifest (the commit) is in the store.
    assert storage.exists(Path("runs/async/step_3") / MANIFEST_FILE_NAME)
    assert not storage.exists(Path("runs/async/step_3") / INCOMPLETE_MARKER)
    assert_round_trip(dict(async_s3.load("runs/async/step_3", into=templates())), want)


# ------------------------------------------------------------------------------------------ the commit rule


def test_overwriting_a_committed_id_is_refused_and_the_old_one_stays(sync_s3: CheckpointManager) -> None:
    sync_s3.save("runs/overwrite/step_4", payload(4))
    with pytest.raises(CommitError, match="cannot replace"):
        sync_s3.save("runs/overwrite/step_4", payload(5))
    assert_round_trip(dict(sync_s3.load("runs/overwrite/step_4", into=templates())), payload(4))


def test_a_prefix_without_a_manifest_is_incomplete(sync_s3: CheckpointManager, storage: FsspecStorage) -> None:
    sync_s3.save("runs/nomanifest/step_6", payload(6))
    storage.delete(Path("runs/nomanifest/step_6") / MANIFEST_FILE_NAME)
    with pytest.raises(IncompleteCheckpointError):
        sync_s3.load("runs/nomanifest/step_6", into=templates())
    with pytest.raises(FileNotFoundError):
        sync_s3.load("runs/never/step_7", into=templates())


def test_a_corrupted_object_is_refused_on_load(sync_s3: CheckpointManager, storage: FsspecStorage) -> None:
    sync_s3.save("runs/corrupt/step_8", payload(8))
    path = Path("runs/corrupt/step_8/model_0.pt")
    data = bytearray(storage.read(path))
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped: only the CRC32 can tell
    storage.write(path, bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt"):
        sync_s3.load("runs/corrupt/step_8", into=templates())
    storage.write(path, bytes(data[:-10]))
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt"):
        sync_s3.load("runs/corrupt/step_8", into=templates())


def test_a_failed_upload_raises_a_named_error_and_the_next_save_works(
    async_s3: CheckpointManager, storage: FsspecStorage
) -> None:
    future = async_s3.save("s3://no-such-bucket/runs/step_9", payload(9))
    assert future is not None
    with pytest.raises(CheckpointError, match="no-such-bucket") as caught:
        future.result(timeout=120)
    assert "ObjectStoreError" in f"{type(caught.value).__name__}: {caught.value}"
    want = payload(10)
    future = async_s3.save("runs/after-failure/step_10", want)
    assert future is not None
    future.result(timeout=120)
    assert_round_trip(dict(async_s3.load("runs/after-failure/step_10", into=templates())), want)


# ------------------------------------------------------------------------------------------ killed mid-upload

CHILD = """
import json, sys, torch
from tests.s3_server import SlowPartsStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
args = json.loads(sys.argv[1])
save = AsyncCheckpointSaverConfig() if args["async"] else SyncCheckpointSaverConfig()
config = SlowPartsStorageConfig(**args["config"])
m = CheckpointManager(CheckpointManager.Config(save=save, storage_config=config))
future = m.save(args["id"], {"model": {"w": torch.ones(3 * args["config"]["part_size"] // 4)}})
if future is not None:
    future.result()
print("SAVED", flush=True)
"""


def _killed_save(config: FsspecStorageConfig, checkpoint_id: str, async_save: bool, signal_file: Path) -> None:
    """Run a save in a new session, SIGKILL the whole group (trainer and writer) once a part is uploaded."""
    args = {
        "async": async_save,
        "id": checkpoint_id,
        "config": {
            "url": config.url,
            "storage_options": config.storage_options,
            "part_size": config.part_size,
            "signal_file": str(signal_file),
            "part_delay_s": 30.0,
        },
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not signal_file.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group already exited: reported below
            os.killpg(child.pid, signal.SIGKILL)  # the trainer and its writer process
        child.wait(30)
    output = child.stdout.read().decode(errors="replace") if child.stdout else ""
    if child.stdout:
        child.stdout.close()
    assert signal_file.exists(), f"the child never uploaded a part (exit {child.returncode}):\n{output[-3000:]}"
    assert child.returncode == -signal.SIGKILL, f"the child was not killed mid-upload:\n{output[-3000:]}"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_killed_mid_upload_commits_nothing_and_the_earlier_checkpoint_stays(
    sync_s3: CheckpointManager,
    bucket_config: FsspecStorageConfig,
    storage: FsspecStorage,
    tmp_path: Path,
    async_save: bool,
) -> None:
    run = f"runs/killed-{'async' if async_save else 'sync'}"
    earlier = payload(11)
    sync_s3.save(f"{run}/step_11", earlier)
    _killed_save(bucket_config, f"{run}/step_12", async_save, tmp_path / "part-uploaded")
    assert not storage.exists(Path(f"{run}/step_12") / MANIFEST_FILE_NAME)
    assert "model_0.pt" not in objects(storage, f"{run}/step_12")  # the multipart upload never completed
    with pytest.raises(IncompleteCheckpointError):
        sync_s3.load(f"{run}/step_12", into=templates())
    assert_round_trip(dict(sync_s3.load(f"{run}/step_11", into=templates())), earlier)
    # The id of the killed save is not lost: a new save there replaces the leftovers and commits.
    again = payload(13)
    sync_s3.save(f"{run}/step_12", again)
    assert_round_trip(dict(sync_s3.load(f"{run}/step_12", into=templates())), again)


def test_a_config_without_protocol_takes_the_store_from_the_ids_scheme(
    s3_server: S3Server,
    bucket_config: FsspecStorageConfig,
) -> None:
    any_scheme = FsspecStorageConfig(storage_options=s3_server.storage_options(), part_size=TEST_PART_SIZE)
    with manager(any_scheme) as m:
        want = payload(14)
        m.save(f"{bucket_config.url}/runs/by-scheme/step_14", want)
        assert_round_trip(dict(m.load(f"{bucket_config.url}/runs/by-scheme/step_14", into=templates())), want)
        with pytest.raises(ValueError, match="no URL scheme|no url root"):
            m.save("runs/relative/step_15", want)
