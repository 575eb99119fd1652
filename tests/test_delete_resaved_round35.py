"""A delete of a checkpoint by its id (`FsspecStorage.rmdir`) that reads the manifest, then finds the id deleted
and saved again by other processes before its claim goes up, and is SIGKILLed among the files.

The delete's claim names the save whose manifest it read first (`collects`); beside the new save's manifest that
claim is a stray claim (`stray_claim`), so readers take the new checkpoint as committed. Before, the delete still
removed the files first and the manifest last under it: killed in between, the id listed and "loaded" the new
checkpoint with its files gone, and gc let go of the claim, committing it so for good. Then a manifest that the
claim up did not own went first, as beside any stray claim: the id did not list or load. Now (round 36) the delete
reads the manifest before it lists the id and holds the id to it (`_manifest_listed`): it deletes nothing of the
second save, which stays whole, and says so; the kill points are never reached.

Real processes: the delete is armed to be SIGKILLed at a chosen file operation, on real files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_killed_delete_round35 import _whole_or_absent as whole_or_absent
from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import REPO, _env
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")

_CHILD = r"""
import os, shutil, signal, subprocess, sys, torch
from pathlib import Path
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig

url, ckpt, folder, killed_at = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
SAVE = '''
import sys, torch
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=sys.argv[1]))
with CheckpointManager(config) as manager:
    manager.save(sys.argv[2], {"model": {"w": torch.arange(float(sys.argv[3]))}, "x": int(sys.argv[3])})
'''

def _save(n):
    subprocess.run([sys.executable, "-c", SAVE, url, ckpt, str(n)], check=True)

class Interleaved(LocalFileSystem):
    # Right after the delete reads the manifest: another process deletes the id, a third saves it again.
    # The delete is then SIGKILLed at its first removal of a file named `killed_at`.
    read = False

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        if os.path.basename(path) == "manifest.json" and not Interleaved.read:
            Interleaved.read = True
            shutil.rmtree(folder)
            _save(3)
        return data

    def rm_file(self, path):
        if os.path.basename(path) == killed_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().rm_file(path)

_save(4)
storage = FsspecStorageConfig(url=url, filesystem=Interleaved()).create_storage()
try:
    storage.rmdir(Path(ckpt))
except Exception as exc:  # the store's error, naming why
    print("REFUSED", exc)
"""


def _whole_or_absent(url: str, ckpt: str) -> None:
    """The id is the second save, whole and loading exactly, or it neither lists nor loads."""
    whole_or_absent(url, ckpt, w=torch.arange(3.0), x=3)


@pytest.mark.parametrize("killed_at", ["manifest.json", "x_0.pt"])
def test_a_delete_killed_after_the_id_was_saved_again_leaves_no_checkpoint_missing_files(
    tmp_path: Path, killed_at: str
) -> None:
    url, ckpt = _root_url("file", tmp_path), "step_1"
    args = [url, ckpt, str(tmp_path / "run" / ckpt), killed_at]
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], cwd=REPO, env=_env(), capture_output=True, timeout=120)
    assert done.returncode == 0 and b"REFUSED" in done.stdout and b"saved again" in done.stdout, done
    _whole_or_absent(url, ckpt)
    assert [Path(i.path).name for i in list_checkpoints(url, FsspecStorageConfig(url=url).create_storage())] == [ckpt]
    report = collect_garbage(url, FsspecStorageConfig(url=url).create_storage(), unowned_after_s=0)
    assert not report.failed, report
    _whole_or_absent(url, ckpt)
