"""gc never deletes a user's file beside a dead save's marker that records nothing of what the save wrote.

An empty `.incomplete` (an earlier version's claim, or its delete's mark) names no file of the save. On an object
store gc removed such a prefix whole: a user's `notes.txt` beside it went with it. On a local disk the folder
was kept, but as "may still be writing it", at INFO, naming no file. Now, on both, a prefix holding files that no
manifest of ours lists is left whole and the kept reason names them and the fix; one holding only what is ours
(the marker, a manifest of ours and its files) is collected as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.s3_server import S3Server, missing_s3_packages
from torch_checkpointing import CheckpointManager, FsspecStorageConfig, SyncCheckpointSaverConfig
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import GcReport, collect_garbage
from torch_checkpointing.storage.base_storage import Storage

pytest.importorskip("fsspec")
needs_s3 = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")


def earlier_versions_killed_save(storage: Storage, config: FsspecStorageConfig, prefix: str) -> list[str]:
    """What an earlier version's save killed between its manifest and its marker's removal leaves at `prefix`:
    its files and manifest (untagged: no writer recorded per object) beside an empty marker; their names."""
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
        m.save(f"{prefix}-source", {"model": {"w": torch.ones(4)}})
    names = storage.ls(Path(f"{prefix}-source"))
    for name in names:
        storage.write(Path(prefix) / name, storage.read(Path(f"{prefix}-source") / name))
    storage.write(Path(prefix) / INCOMPLETE_MARKER, b"")
    return names


def _check_kept(report: GcReport) -> None:
    ((leftover, why),) = report.kept
    assert Path(leftover.path).name == "x" and "notes.txt" in why and "by hand" in why, report
    assert not report.removed and not report.failed, report


@needs_s3
def test_s3_keeps_a_users_file_beside_an_empty_marker(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    storage.write(Path("run/x/.incomplete"), b"")
    storage.write(Path("run/x/notes.txt"), b"mine")
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    _check_kept(report)
    assert sorted(storage.ls(Path("run/x"))) == [".incomplete", "notes.txt"]


@needs_s3
def test_s3_still_collects_a_lone_empty_marker(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    storage.write(Path("run/x/.incomplete"), b"")
    storage.write(Path("run/y/notes.txt"), b"mine")
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    assert [Path(lo.path).name for lo in report.removed] == ["x"] and not report.kept, report
    assert storage.ls(Path("run")) == ["y"]


def test_local_names_a_users_file_beside_an_empty_marker(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "x"
    folder.mkdir(parents=True)
    (folder / INCOMPLETE_MARKER).write_bytes(b"")
    (folder / "notes.txt").write_text("mine")
    _check_kept(collect_garbage(tmp_path / "run", unowned_after_s=0))
    assert sorted(os.listdir(folder)) == [INCOMPLETE_MARKER, "notes.txt"]


def test_fsspec_file_keeps_a_users_file_beside_an_empty_marker(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/run"
    storage = FsspecStorageConfig(url=url).create_storage()
    (tmp_path / "run" / "x").mkdir(parents=True)
    storage.write(Path("x") / INCOMPLETE_MARKER, b"")
    storage.write(Path("x") / "notes.txt", b"mine")
    _check_kept(collect_garbage(url, storage, unowned_after_s=0))
    assert sorted(os.listdir(tmp_path / "run" / "x")) == [INCOMPLETE_MARKER, "notes.txt"]


@needs_s3
def test_s3_collects_an_earlier_versions_save_whole_and_keeps_one_holding_a_users_file(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    names = earlier_versions_killed_save(storage, config, "run/a")
    earlier_versions_killed_save(storage, config, "run/x")
    storage.write(Path("run/x/notes.txt"), b"mine")
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    assert [Path(lo.path).name for lo in report.removed] == ["a"], report
    assert [Path(lo.path).name for lo, _ in report.kept] == ["x"] and "notes.txt" in report.kept[0][1], report
    assert "model_0.pt" not in report.kept[0][1] and not any(storage.exists(Path("run/a") / n) for n in names)
    assert "notes.txt" in storage.ls(Path("run/x"))
