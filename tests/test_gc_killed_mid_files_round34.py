"""A gc SIGKILLed while it deletes the files of a dead save that had written its manifest.

The save died after writing its manifest and before removing its marker (its records gone already: the
manifest is the only list of its files). gc held the id with its own claim, deleted the manifest first, then
the files it listed. Killed between the two, it left those files with nothing naming them as the save's: the
next gc "left 2 object(s) in place that were not written by this save", the save's own `model_0.pt` and
`x_0.pt`, for good, and every later save of the id was refused while they were there. gc's claim (it names
the save it collects) already keeps that manifest from reading as a committed checkpoint, so the manifest now
goes after the files it lists, and the next gc finds them listed.

Real processes killed with SIGKILL at a chosen delete, on real files (fsspec `file://`: no tags, records).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import _plain_manager
from tests.test_objstore_round22_review import _killed_at
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.commit import Claim
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import IncompleteCheckpointError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")


@pytest.mark.parametrize("kill_at", ["model_0.pt", "x_0.pt"])
def test_a_gc_killed_among_the_files_its_manifest_lists_leaves_them_to_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kill_at: str
) -> None:
    url, ckpt = _root_url("file", tmp_path), "step_3"
    storage = FsspecStorageConfig(url=url).create_storage()
    prefix = tmp_path / "run" / ckpt
    _killed_at("save", url, ckpt, INCOMPLETE_MARKER)
    assert {"manifest.json", "model_0.pt", "x_0.pt"} <= set(os.listdir(prefix)), os.listdir(prefix)
    _killed_at("gc", url, ckpt, kill_at)
    held = Claim.parse((prefix / INCOMPLETE_MARKER).read_bytes())
    assert held is not None and held.is_gc(), held  # gc was killed holding the id
    assert not list_checkpoints(url, storage)  # never a committed checkpoint
    with _plain_manager(url) as manager, pytest.raises(IncompleteCheckpointError):
        manager.load(ckpt)
    gc_leaves_the_id_free(url, ckpt, prefix, caplog)


def gc_leaves_the_id_free(url: str, ckpt: str, prefix: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The next gc removes all that is under `prefix` (no failure, no file "left in place" as not the save's),
    and a save of `ckpt` then commits."""
    storage = FsspecStorageConfig(url=url).create_storage()
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        report = collect_garbage(url, storage, unowned_after_s=0)
    assert not report.failed, report
    assert "in place" not in caplog.text, caplog.text
    assert not prefix.exists() or not os.listdir(prefix), os.listdir(prefix)
    with _plain_manager(url) as manager:  # the id is free again
        manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
    assert [Path(info.path).name for info in list_checkpoints(url, storage)] == [ckpt]
