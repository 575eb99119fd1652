"""A failed save SIGKILLed while it removes what it wrote leaves its files to the next gc, named as its own.

The save's commit failed at its last step (the removal of its marker was refused), after its records were gone:
its manifest was the only list of its files. Its cleanup (`_discard_claimed`) deleted that manifest first, then
the files; killed between the two, it left them with nothing naming them: the next gc said it "left 2
object(s) in place that were not written by this save" (the save's own `model_0.pt`, `x_0.pt`), removed the
marker, and every later save of the id was refused while they were there. The manifest now goes after the files
it lists, as gc's own removal does.

A real process killed with SIGKILL at a chosen delete, on real files (fsspec `file://`: no tags, records).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_gc_killed_mid_files_round34 import gc_leaves_the_id_free
from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import _run_until_sigkilled
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.discovery import list_checkpoints

pytest.importorskip("fsspec")

_CHILD = r"""
import os, signal, sys, torch
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig

url, ckpt, kill_at = sys.argv[1:4]
refused = []

class MarkerRefusedOnceThenKilled(LocalFileSystem):
    # The commit's removal of its marker (beside its manifest) is refused once; the save's cleanup is then
    # SIGKILLed as it deletes `kill_at`.
    def rm_file(self, path):
        committing = os.path.exists(os.path.join(os.path.dirname(path), "manifest.json"))
        if os.path.basename(path) == ".incomplete" and not refused and committing:
            refused.append(path)
            raise PermissionError(13, "refused", path)
        if refused and os.path.basename(path) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().rm_file(path)

storage = FsspecStorageConfig(url=url, filesystem=MarkerRefusedOnceThenKilled())
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage)) as manager:
    manager.save(ckpt, {"model": {"w": torch.arange(4.0)}, "x": 1})
"""


@pytest.mark.parametrize("kill_at", ["model_0.pt", "x_0.pt"])
def test_a_failed_save_killed_among_its_files_leaves_them_to_the_next_gc(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kill_at: str
) -> None:
    url, ckpt = _root_url("file", tmp_path), "step_1"
    storage = FsspecStorageConfig(url=url).create_storage()
    prefix = tmp_path / "run" / ckpt
    _run_until_sigkilled(_CHILD, url, ckpt, kill_at)
    assert kill_at in os.listdir(prefix), os.listdir(prefix)  # killed among its files
    assert not list_checkpoints(url, storage)
    gc_leaves_the_id_free(url, ckpt, prefix, caplog)
