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

from pathlib import Path

import pytest

from tests.test_gc_users_files_round33 import earlier_versions_killed_save
from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import _plain_manager
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
