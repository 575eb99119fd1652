"""A gc SIGKILLed while it moves an earlier version's unfinished save aside on fsspec `file://`.

gc collects such a save (an empty marker beside the manifest it wrote before it died) whole: it moves the
prefix to a trash name, then removes that. On `file://` the move copies each file, then deleted the source's
in listing order: the marker first, the manifest last. Killed in between, the source held the manifest and
some files without a marker: the killed save listed and loaded as a committed checkpoint (or listed with its
files gone), and the next gc left it so. The source now goes as a delete's does: the manifest first, the
marker last.

Real processes killed with SIGKILL at a chosen delete, on real files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_gc_users_files_round33 import earlier_versions_killed_save
from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import _plain_manager, _run_until_sigkilled
from tests.test_objstore_round22_review import _killed_at
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")


@pytest.mark.parametrize("kill_at", ["model_0.pt", "manifest.json"])
def test_a_gc_killed_moving_an_earlier_versions_save_never_commits_it(tmp_path: Path, kill_at: str) -> None:
    url, ckpt = _root_url("file", tmp_path), "step_3"
    config = FsspecStorageConfig(url=url)
    storage = config.create_storage()
    for name in (ckpt, f"{ckpt}-source"):
        (tmp_path / "run" / name).mkdir(parents=True)
    earlier_versions_killed_save(storage, config, ckpt)
    _killed_at("gc", url, ckpt, kill_at)
    assert [Path(c.path).name for c in list_checkpoints(url, storage)] == [f"{ckpt}-source"]
    with _plain_manager(url) as manager, pytest.raises(CheckpointError):
        manager.load(ckpt)
    report = collect_garbage(url, storage, unowned_after_s=0)
    assert not report.failed, report
    assert [Path(c.path).name for c in list_checkpoints(url, storage)] == [f"{ckpt}-source"]
    assert not (tmp_path / "run" / ckpt).exists()


# gc SIGKILLed as it deletes `model_0.pt` from the trash it moved the save to (the move itself done).
_KILLED_IN_TRASH = r"""
import os, signal, sys
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.retention import collect_garbage

class KilledInTrash(LocalFileSystem):
    def rm_file(self, path):
        if ".trash-" in path and os.path.basename(path) == "model_0.pt":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().rm_file(path)

url = sys.argv[1]
collect_garbage(url, FsspecStorageConfig(url=url, filesystem=KilledInTrash()).create_storage(), unowned_after_s=0)
"""


def test_a_gc_killed_removing_its_trash_leaves_one_the_next_gc_removes(tmp_path: Path) -> None:
    """The trash went as its listing came: the marker first, then the manifest, then the files. Killed among
    the files, it held neither: "named like a trash directory of ours but holds no manifest.json or
    .incomplete of ours: not removed", for good. The trash's files now go as any directory's: its manifest
    first, its marker last."""
    url, ckpt = _root_url("file", tmp_path), "step_3"
    config = FsspecStorageConfig(url=url)
    storage = config.create_storage()
    for name in (ckpt, f"{ckpt}-source"):
        (tmp_path / "run" / name).mkdir(parents=True)
    earlier_versions_killed_save(storage, config, ckpt)
    _run_until_sigkilled(_KILLED_IN_TRASH, url)
    (trash,) = [name for name in os.listdir(tmp_path / "run") if ".trash-" in name]
    report = collect_garbage(url, storage, unowned_after_s=0)
    assert not report.kept and not report.failed, report
    assert [Path(lo.path).name for lo in report.removed] == [trash], report
    assert sorted(os.listdir(tmp_path / "run")) == [f"{ckpt}-source"]
