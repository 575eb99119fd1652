"""A `~` path means the home directory where round 31 left it literal (round 32): a staging directory, the ids
that retention protects, and the checkpoint `load_distributed_metadata` reads."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from tests.home_dirs import home_and_work
from torch_checkpointing import (
    CheckpointManager,
    DTensorResharder,
    ItemSpec,
    latest_checkpoint,
    list_checkpoints,
    retention,
)
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import load_distributed_metadata
from torch_checkpointing.retention import RetentionPolicy
from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def _slab_files() -> set[str]:
    """Where this process's staging slabs held in a directory live (their unlinked files' directories)."""
    found = set()
    for entry in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:  # the listing's own descriptor, closed since
            continue
        if "torch_checkpointing-staging" in target and target.endswith(".slab (deleted)"):
            found.add(os.path.dirname(target))
    return found


def test_a_home_staging_dir_stages_under_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: `staging_dir="~/stage"` was taken literally: the first staged save failed with OSError "Cannot
    create the async staging slab in ~/stage (No such file or directory)" though the directory exists."""
    home, work = tmp_path / "home", tmp_path / "work"
    (home / "stage").mkdir(parents=True)
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    config = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False, staging_dir="~/stage")
    stager = DefaultStager(config)
    try:
        staged = stager.stage({"m": {"x": torch.arange(4.0)}})
        assert torch.equal(staged["m"]["x"], torch.arange(4.0))
        assert str(home / "stage") in _slab_files()
    finally:
        stager.close()
    assert not (work / "~").exists()


@pytest.fixture
def home_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Steps 1 to 3 saved as '~/run/step_N', HOME a fresh directory, the working directory another."""
    home, _ = home_and_work(tmp_path, monkeypatch)
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
    with CheckpointManager(config) as manager:
        for step in (1, 2, 3):
            manager.save(f"~/run/step_{step}", {"m": {"x": torch.ones(2)}})
    return home


@pytest.mark.parametrize("root", ["~/run", "{home}/run"], ids=["home-root", "absolute-root"])
@pytest.mark.parametrize("prune_call", ["prune", "apply_retention"])
def test_a_home_protect_id_keeps_its_checkpoint(home_run: Path, root: str, prune_call: str) -> None:
    """Defect: `prune(root, RetentionPolicy(keep_last=1), protect=["~/run/step_1"])` deleted step_1: the id was
    compared as a path named '~' under the working directory, which no listed checkpoint is."""
    call = getattr(retention, prune_call)
    call(root.format(home=home_run), RetentionPolicy(keep_last=1), protect=["~/run/step_1"])
    assert [info.step for info in list_checkpoints(home_run / "run")] == [1, 3]


def test_load_distributed_metadata_reads_a_home_checkpoint(home_run: Path) -> None:
    """Defect: `load_distributed_metadata("~/run/resharded", storage)` returned None, the answer for a checkpoint
    that holds no metadata.json, of one that holds it."""
    config = CheckpointManager.Config(
        items={"m": ItemSpec(resharder=DTensorResharder())}, save=SyncCheckpointSaverConfig()
    )
    with CheckpointManager(config) as manager:
        manager.save("~/run/resharded", {"m": {"x": torch.ones(2)}})
    storage = LocalFileSystemStorageConfig().create_storage()
    expected = load_distributed_metadata(home_run / "run" / "resharded", storage)
    assert expected is not None
    assert load_distributed_metadata("~/run/resharded", storage) == expected


def test_an_object_store_key_starting_with_a_tilde_is_a_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Defect: with `FsspecStorageConfig(url="memory://...")`, `save("~/a", ...)` expanded the key to the local home
    directory and refused it ("Checkpoint id '/home/.../a' is an absolute path, but FsspecStorageConfig.url ...
    is a root for relative ids only"), naming a path the caller never gave, while `latest_checkpoint("~", storage)`
    on the same store reads the key '~' as it is (`discovery.user_path`)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    url = f"memory://bucket-{uuid.uuid4().hex}/root"
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
    with CheckpointManager(config) as manager:
        manager.save("~/a", {"m": {"x": torch.ones(2)}})
    found = latest_checkpoint("~", FsspecStorageConfig(url=url).create_storage())
    assert found is not None and found.path == "~/a"  # under the url root, as listed
    assert list(tmp_path.iterdir()) == []
