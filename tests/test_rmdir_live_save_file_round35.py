"""A removal of an id on `file://` (fsspec) while a save of it runs in another process is refused, and the save
goes on whole, as on S3 (tests/test_s3_rmdir_live_save_round27.py).

`FsspecStorage.rmdir` on a directory store removed the tree without reading the claim: the running save's claim
and files went, and the save, held before its manifest or before its claim's removal, then failed with a bare
FileNotFoundError over an id that held nothing. The save runs in a real child process on real files, paused at
one step of its commit until the test releases it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import _CHILD_TIMEOUT_S, REPO, _env, _plain_manager
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.errors import ObjectStoreError

pytest.importorskip("fsspec")

_CHILD = r"""
import os, sys, time, torch
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig

url, held, release, hold_on = sys.argv[1:5]

class Holding(LocalFileSystem):
    # Paused (after touching `held`) at the manifest's write or the marker's removal, until `release` exists.
    done = False

    def _hold(self, path, name):
        if os.path.basename(path) == name and not Holding.done:
            Holding.done = True
            open(held, "w").close()
            while not os.path.exists(release):
                time.sleep(0.05)

    def rm_file(self, path):
        if hold_on == "marker":
            self._hold(path, ".incomplete")
        return super().rm_file(path)

    def open(self, path, mode="rb", **kwargs):
        if hold_on == "manifest" and "w" in mode:
            self._hold(path, "manifest.json")
        return super().open(path, mode, **kwargs)

storage = FsspecStorageConfig(url=url, filesystem=Holding())
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage)
with CheckpointManager(config) as manager:
    manager.save("z", {"model": {"w": torch.full((1000,), 1.0)}})
print("SAVED")
"""


@pytest.mark.parametrize("hold_on", ["manifest", "marker"])
def test_removing_an_id_whose_save_is_running_is_refused_and_the_save_commits_whole(
    tmp_path: Path, hold_on: str
) -> None:
    url = _root_url("file", tmp_path)
    held, release = tmp_path / "held", tmp_path / "release"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, url, str(held), str(release), hold_on],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + _CHILD_TIMEOUT_S
        while not held.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.exists(), child.communicate(timeout=_CHILD_TIMEOUT_S)[0].decode(errors="replace")[-3000:]
        storage = FsspecStorageConfig(url=url).create_storage()
        with pytest.raises(ObjectStoreError, match=r"z/\.incomplete is held by another save"):
            storage.rmdir(Path("z"))
    finally:
        release.touch()
        output = child.communicate(timeout=_CHILD_TIMEOUT_S)[0].decode(errors="replace")
    assert "SAVED" in output, output[-3000:]
    with _plain_manager(url) as manager:
        assert torch.equal(manager.load("z")["model"]["w"], torch.full((1000,), 1.0))
    storage.rmdir(Path("z"))  # once the save is done, the id goes as asked
    assert not os.path.exists(tmp_path / "run" / "z")
