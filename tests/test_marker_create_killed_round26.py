"""Round 26: a save SIGKILLed inside its marker's create, on a filesystem without O_TMPFILE (NFS, off Linux).

There the claim's bytes go into a hidden file beside the marker, which is then linked under the marker's name and
removed. A save killed between that file's create and its link left it alone in the id's folder: every later save
of the id refused it ("a directory that is not a checkpoint ... it holds ..incomplete.<hex>.creating") and gc
never collected it. Killed between the link and the removal, the file stayed beside the claim, and the next save
of the id (taking the dead claim over) committed a checkpoint holding it: a file its manifest does not list.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.names import creating_name
from torch_checkpointing.storage import fsspec_storage

pytest.importorskip("fsspec")

REPO = Path(__file__).resolve().parent.parent
_CHILD_TIMEOUT_S = 120

# A save on a filesystem without O_TMPFILE that SIGKILLs itself inside its marker's create: after the hidden
# file's bytes are written ("before the link"), or after the link, before the hidden file's removal.
_KILLED_CHILD = r"""
import json, os, signal, sys
import torch
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.names import creating_name
from torch_checkpointing.storage import fsspec_storage

args = json.loads(sys.argv[1])
fsspec_storage._HAS_TMPFILE_LINKS = False
real_write, real_link = fsspec_storage._write_all, os.link

def killed_after_write(fd, data):
    real_write(fd, data)
    os.kill(os.getpid(), signal.SIGKILL)

def killed_after_link(*a, **k):
    real_link(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)

if args["at"] == "before the link":
    fsspec_storage._write_all = killed_after_write
else:
    os.link = killed_after_link
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=args["url"]))
with CheckpointManager(config) as manager:
    manager.save(args["id"], {"model": {"w": torch.zeros(3)}})
"""


def _killed_save(url: str, ckpt: str, at: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = json.dumps({"url": url, "id": ckpt, "at": at})
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_CHILD, args], cwd=REPO, env=env, capture_output=True, timeout=_CHILD_TIMEOUT_S
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode(errors="replace")[-3000:]


@pytest.mark.parametrize("at", ["before the link", "after the link"])
def test_a_save_killed_inside_its_markers_create_leaves_the_id_to_the_next_save_with_nothing_of_its_own(
    at: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fsspec_storage, "_HAS_TMPFILE_LINKS", False)  # the same filesystem, seen from here too
    url, ckpt = f"file://{tmp_path}/run", "step_1"
    _killed_save(url, ckpt, at)
    hidden = [name for name in os.listdir(tmp_path / "run" / ckpt) if ".creating" in name]
    assert len(hidden) == 1, os.listdir(tmp_path / "run" / ckpt)  # the kill came inside the create
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
    with CheckpointManager(config) as manager:
        manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
        restored = manager.load(ckpt)
    assert torch.equal(restored["model"]["w"], torch.arange(3.0))
    left = sorted(os.listdir(tmp_path / "run" / ckpt))
    assert not [name for name in left if name.startswith(".")], left  # nothing of the killed create stays
    assert hidden[0] in caplog.text, caplog.text  # its removal is named


def test_a_killed_creators_file_of_this_very_pid_goes_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A job restarted in a container often gets the pid of the one that was killed: its leftover names this
    process's pid (another nonce). Judged by the pid alone (alive) it stayed, for a minute, and the save committed
    a checkpoint holding it."""
    monkeypatch.setattr(fsspec_storage, "_HAS_TMPFILE_LINKS", False)
    url, ckpt = f"file://{tmp_path}/run", "step_1"
    folder = tmp_path / "run" / ckpt
    folder.mkdir(parents=True)
    left = folder / creating_name(".incomplete")  # what a killed process of this pid left before its link
    left.write_bytes(b'{"claim": "of the killed job"}')
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
    with CheckpointManager(config) as manager:
        manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
        assert torch.equal(manager.load(ckpt)["model"]["w"], torch.arange(3.0))
    assert sorted(os.listdir(folder)) == ["manifest.json", "model_0.pt"], os.listdir(folder)
    assert left.name in caplog.text, caplog.text
