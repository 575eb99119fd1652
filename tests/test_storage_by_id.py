"""A manager built without a storage config takes its storage from the first checkpoint id.

`s3://bucket/run/step_1` selects S3 through fsspec (against the real moto server of tests/s3_server.py, reached
the way a user's job reaches a store: AWS_* variables in the environment), a plain path or `file://` URL the
local filesystem; a later id of another storage is refused, as is an id a configured storage cannot take.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_server import S3Server
from torch_checkpointing import CheckpointManager, FsspecStorageConfig, LocalFileSystemStorageConfig
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.discovery import checkpoint_info
from torch_checkpointing.storage import fsspec_storage_for


def payload(seed: int) -> dict[str, Any]:
    return {"model": {"w": torch.arange(6.0) + seed}, "progress": {"step": seed}}


def sync_manager(**kwargs: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), **kwargs))


@pytest.fixture
def bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket, and the environment a job on a real store would have (the writer process inherits it)."""
    name = f"byid-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(name)
    for key, value in s3_server.client_env().items():
        monkeypatch.setenv(key, value)
    return name


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_s3_id_without_a_storage_config_saves_and_loads_on_s3(
    bucket: str,
    s3_server: S3Server,
    async_save: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    save = AsyncCheckpointSaverConfig() if async_save else SyncCheckpointSaverConfig()
    with CheckpointManager(CheckpointManager.Config(save=save)) as manager:
        written = manager.save(f"s3://{bucket}/run/step_1", payload(1))
        if written is not None:
            written.result(timeout=120)
        manager.save(f"s3://{bucket}/run/step_2", payload(2), metrics={"loss": 0.5})
        manager.close()  # the async save's commit, before the read below
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as reader:
        got = reader.load(f"s3://{bucket}/run/step_2", {"model": {"w": torch.zeros(6)}, "progress": None})
    assert torch.equal(got["model"]["w"], torch.arange(6.0) + 2) and got["progress"] == {"step": 2}
    on_s3 = FsspecStorageConfig(protocol="s3", storage_options=s3_server.storage_options()).create_storage()
    info = checkpoint_info(f"s3://{bucket}/run/step_2", on_s3)
    assert info.step == 2 and info.metrics == {"loss": 0.5}
    assert not (tmp_path / "s3:").exists(), "a local directory named 's3:' was created"


def test_after_an_s3_id_a_local_id_is_refused(bucket: str, tmp_path: Path) -> None:
    with sync_manager() as manager:
        manager.save(f"s3://{bucket}/run/step_1", payload(1))
        with pytest.raises(ValueError, match=r"picked by its first id 's3://.*/run/step_1' \(the s3:// store\)"):
            manager.save(str(tmp_path / "step_2"), payload(2))
        with pytest.raises(ValueError, match="first id"):
            manager.load(f"gs://{bucket}/run/step_1")
        assert manager.load(f"s3://{bucket}/run/step_1")["progress"] == {"step": 1}
    assert not (tmp_path / "step_2").exists()


def test_after_a_local_id_an_s3_id_is_refused(tmp_path: Path) -> None:
    with sync_manager() as manager:
        manager.save(str(tmp_path / "step_1"), payload(1))
        with pytest.raises(ValueError, match=r"is on the s3:// store, but .* \(the local filesystem\)"):
            manager.save("s3://bucket/run/step_2", payload(2))
        manager.save(str(tmp_path / "step_2"), payload(2))  # the local storage still works


def test_a_file_url_is_the_local_filesystem(tmp_path: Path) -> None:
    with sync_manager() as manager:
        manager.save(f"file://{tmp_path}/step_1", payload(1))
        assert manager.load(str(tmp_path / "step_1"))["progress"] == {"step": 1}  # the same storage: a path
    assert checkpoint_info(tmp_path / "step_1").step == 1
    with sync_manager(storage_config=LocalFileSystemStorageConfig()) as manager:
        assert manager.load(f"file://localhost{tmp_path}/step_1")["progress"] == {"step": 1}
        with pytest.raises(ValueError, match="names the host 'elsewhere'"):
            manager.load(f"file://elsewhere{tmp_path}/step_1")


def test_without_fsspec_an_s3_id_names_the_extra_and_the_manager_stays_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An S3 filesystem this process already built (another test's, in the same worker) is shared by the
    # storages that name the same store: the refusal must not depend on whether one was built before.
    fsspec_storage_for("s3", "s3://bucket/warm")
    monkeypatch.setitem(sys.modules, "fsspec", None)  # `import fsspec` raises ImportError, as when not installed
    with sync_manager() as manager:
        with pytest.raises(ImportError, match=r"s3://bucket/run/step_1.*pip install 'torch-checkpointing\[s3\]'"):
            manager.save("s3://bucket/run/step_1", payload(1))
        manager.save(str(tmp_path / "step_1"), payload(1))  # no storage was picked by the refused id
        assert manager.load(str(tmp_path / "step_1"))["progress"] == {"step": 1}


def test_an_explicit_local_storage_refuses_a_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with (
        sync_manager(storage_config=LocalFileSystemStorageConfig()) as manager,
        pytest.raises(ValueError, match=r"LocalFileSystemStorageConfig\) does not take it .*directory named 's3:'"),
    ):
        manager.save("s3://bucket/run/step_1", payload(1))
    assert not (tmp_path / "s3:").exists()


def test_an_explicit_object_store_refuses_what_it_cannot_take(s3_server: S3Server) -> None:
    config = FsspecStorageConfig(protocol="s3", storage_options=s3_server.storage_options())
    with sync_manager(storage_config=config) as manager:
        with pytest.raises(ValueError, match=r"'gs://bucket/step_1' is a gs:// URL.*FsspecStorageConfig\)"):
            manager.save("gs://bucket/step_1", payload(1))
        with pytest.raises(ValueError, match=r"'runs/step_1' is a local path.*no url root"):
            manager.save("runs/step_1", payload(1))
