"""Object-store defects found in round 15, against a real S3 API server (moto) on loopback.

* A retention delete on S3 "renames" a checkpoint to its trash name by copying every object, then deleting the
  source in bulk (1000 keys a request), manifest last. A delete cut after its first batch left the source with
  its manifest and a part of its files: listed as committed, refused by load as corrupt. A copy cut midway left
  a trash prefix holding neither manifest nor marker, which gc never collected (files nothing claims).
* The pass a save triggers protected that save's checkpoint only when the policy's root was spelt as the ids
  were: a full-URL root with ids relative to the store's `url` deleted the checkpoint just saved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import checkpoint_names, state, sync_manager, through_proxy, two_saved
from torch_checkpointing import CheckpointManager, RetentionPolicy, latest_checkpoint, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.hf import export_hf
from torch_checkpointing.retention import collect_garbage, prune
from torch_checkpointing.storage import fsspec_storage


def test_a_retention_delete_cut_after_its_first_bulk_delete_leaves_no_committed_half(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    root = f"{config.url}/run"
    with sync_manager(config) as manager:
        manager.save("run/step_1", {f"k{i}": {"w": torch.full((4,), float(i))} for i in range(4)})
        manager.save("run/step_2", state(2.0))
    real_batch, calls = fsspec_storage._delete_batch, [0]

    def cut_after_the_first(backend: Any, keys: list[str]) -> list[str]:
        calls[0] += 1
        if calls[0] == 2:  # after one batch of files (the manifest went first, on its own)
            raise OSError("the process was killed here")
        return real_batch(backend, keys)

    monkeypatch.setattr(fsspec_storage, "_DELETE_BATCH", 2)  # S3's 1000, scaled to a small checkpoint
    monkeypatch.setattr(fsspec_storage, "_delete_batch", cut_after_the_first)
    report = prune(root, RetentionPolicy(keep_last=1), storage)
    monkeypatch.undo()
    assert calls[0] >= 2  # cut at the second; the later ones removed the trash copy once it was put back
    assert [c.name for c, _ in report.failed] == ["step_1"], report
    assert not [name for name in storage.ls(Path("run")) if ".trash-" in name]
    # The source had lost files, so its whole copy in the trash went back under its id (round 24: before, the
    # copy was deleted too and the checkpoint was gone, reported as "could not delete").
    assert checkpoint_names(storage, root) == ["step_1", "step_2"]
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/step_1")["k3"]["w"], torch.full((4,), 3.0))
    collect_garbage(root, storage, unowned_after_s=0)
    prune(root, RetentionPolicy(keep_last=1), storage)
    assert storage.ls(Path("run")) == ["step_2"]


def test_a_retention_delete_whose_copy_fails_midway_leaves_no_trash(s3_server: S3Server) -> None:
    config, port, storage, root = two_saved(s3_server)
    with FaultProxy(port) as proxy:
        proxy.rules = [Rule(r"^PUT \S*\.trash-\S*/model_0\.pt")]  # the copy of one data file to the trash name
        report = prune(root, RetentionPolicy(keep_last=1), through_proxy(config, proxy).create_storage())
    assert [c.name for c, _ in report.failed] == ["step_1"], report
    assert checkpoint_names(storage, root) == ["step_1", "step_2"]  # the source is untouched
    # The partial copy in the trash is removed by the failed delete itself (before: left for gc to collect).
    gc = collect_garbage(root, storage, unowned_after_s=0)
    assert gc.removed == [] and gc.failed == [], gc
    assert sorted(storage.ls(Path("run"))) == ["step_1", "step_2"]
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(1.0)["model"]["w"])


def test_the_pass_after_a_save_keeps_it_when_the_policy_root_is_a_full_url(s3_server: S3Server) -> None:
    config = s3_server.config()
    root = f"{config.url}/run"
    retention = RetentionPolicy(keep_last=1, root=root)
    manager_config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), storage_config=config, retention=retention
    )
    with CheckpointManager(manager_config) as manager:
        for step in (1000, 2000, 0):  # a run restarted at step 0
            manager.save(f"run/step_{step}", state(float(step)))
    # step_0 just saved, step_2000 the newest by step (always kept); before, step_0 was deleted at once
    assert checkpoint_names(config.create_storage(), root) == ["step_0", "step_2000"]


# ------------------------------------------------------------------------ a URL root without a storage passed


def test_lookups_and_prune_of_a_url_root_without_a_storage_find_the_run(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before: `latest_checkpoint("s3://b/run")` returned None, listing gave [] and prune deleted nothing, all
    silently (the URL was looked up as a local path): a resume started from scratch."""
    for name, value in s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    config = s3_server.config()
    root = f"{config.url}/run"
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
        manager.save("run/step_2", state(2.0))
    latest = latest_checkpoint(root)
    assert latest is not None and latest.step == 2 and latest.path == f"{root}/step_2"
    assert [c.name for c in list_checkpoints(root)] == ["step_1", "step_2"]
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as plain:
        # the documented resume: the listed path, loaded by a manager built without a storage config
        assert torch.equal(plain.load(latest.path)["model"]["w"], state(2.0)["model"]["w"])
    assert [c.name for c in prune(root, RetentionPolicy(keep_last=1)).deleted] == ["step_1"]
    assert not any(tmp_path.iterdir())  # no local folder named `s3:`


def test_a_file_url_root_is_refused_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="local path"):
        list_checkpoints(f"file://{tmp_path}")


def test_an_export_to_a_url_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with sync_manager_local() as manager:
        manager.save("run/step_1", state(1.0))
    with pytest.raises(ConfigError, match="local directory"):
        export_hf("run/step_1", "model", "s3://bucket/hf")
    assert sorted(os.listdir(tmp_path)) == ["run"]  # before: ./s3:/bucket/hf held the export


def sync_manager_local() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))
