"""A delete of a committed checkpoint on S3 (the moto server), SIGKILLed at each of its steps, with and without
the save's tags (an untagged store: no writer recorded per object).

The move to the trash is a copy, then a delete of the id's objects under the delete's claim. Before, that claim
named no save and the manifest went first: killed among the files, the id held them beside a claim that records
nothing. Untagged, gc kept the prefix whole for a person to empty ("records none of the files its save wrote"),
the checkpoint's own files named as maybe a user's, and every later save of the id took over a prefix holding
them. Now the claim names the manifest's save and the manifest goes after the files it lists: at every kill point
the id is whole and loads exactly, or does not list or load, and the next gc removes what is left of ours, never
a user's file, which it names.

Real processes killed with SIGKILL at a chosen request, against a real S3 API server.
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

from tests.s3_server import S3Server, missing_s3_packages
from tests.test_s3_attacks import sync_manager
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.retention import collect_garbage

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")

_CHILD = r"""
import json, os, signal, sys, torch
import s3fs
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import delete_checkpoint
from torch_checkpointing.storage.fsspec_storage import FsspecStorage

a = json.loads(sys.argv[1])
seen = []

def _at(kind, names):
    if kind == a["op"] and a["name"] in [os.path.basename(n) for n in names]:
        seen.append(names)
        if len(seen) == a["nth"]:
            os.kill(os.getpid(), signal.SIGKILL)

class KilledAt(s3fs.S3FileSystem):
    # SIGKILLed at the `nth` removal (rm), copy (cp) or bulk delete (bulk) naming a file `name`.
    # (the coroutines: s3fs makes the blocking methods from them)
    async def _rm_file(self, path, **kwargs):
        _at("rm", [path])
        return await super()._rm_file(path, **kwargs)

    async def _cp_file(self, path1, path2, **kwargs):
        _at("cp", [path1])
        return await super()._cp_file(path1, path2, **kwargs)

    def call_s3(self, method, *args, **kwargs):  # the storage's bulk delete calls this one
        if method == "delete_objects":
            _at("bulk", [o["Key"] for o in kwargs["Delete"]["Objects"]])
        return super().call_s3(method, *args, **kwargs)

class Untagged(FsspecStorage):
    def own_writes(self, root, token):
        return False  # a store that records no writer per object

class UntaggedConfig(FsspecStorageConfig):
    def create_storage(self):
        return Untagged(self)

kind = UntaggedConfig if a["untagged"] else FsspecStorageConfig
config = kind(url=a["url"], storage_options=a["options"])
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
    m.save(a["id"], {"model": {"w": torch.arange(4.0)}, "x": 1})
killed = FsspecStorageConfig(url=a["url"], filesystem=KilledAt(**a["options"]))
delete_checkpoint(a["id"], killed.create_storage())
"""

# (operation, file name, which one): the copy to the trash, the removal of the id's objects (its claim's, its
# files', its manifest's), the removal of the trash's.
_KILL_POINTS = [
    ("cp", "model_0.pt", 1),
    ("cp", "manifest.json", 1),
    ("rm", ".incomplete", 1),  # the trash's claim, once the copy is whole
    ("bulk", "model_0.pt", 1),
    ("rm", "manifest.json", 1),
    ("rm", ".incomplete", 2),
    ("bulk", "model_0.pt", 2),
    ("rm", "manifest.json", 2),
]


def _killed_delete(s3_server: S3Server, untagged: bool, op: str, name: str, nth: int) -> FsspecStorageConfig:
    config = s3_server.config()
    args = {"url": f"{config.url}/run", "options": s3_server.storage_options(), "id": "step_1"}
    args.update(untagged=untagged, op=op, name=name, nth=nth)
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)], env=env, capture_output=True, timeout=180, cwd=repo
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode(errors="replace")[-3000:]
    return FsspecStorageConfig(url=f"{config.url}/run", storage_options=s3_server.storage_options())


def _whole_or_absent(config: FsspecStorageConfig) -> bool:
    """The id is a committed checkpoint that loads exactly (True), or it neither lists nor loads (False)."""
    listed = [Path(info.path).name for info in list_checkpoints(config.url, config.create_storage())]
    with sync_manager(config) as manager:
        if listed == ["step_1"]:
            state = manager.load("step_1")
            assert torch.equal(state["model"]["w"], torch.arange(4.0)) and state["x"] == 1, state
            return True
        assert listed == [], listed
        with pytest.raises((CheckpointError, FileNotFoundError)):
            manager.load("step_1")
    return False


def _left(config: FsspecStorageConfig) -> list[str]:
    """Every object under the root, relative to it."""
    storage = config.create_storage()
    root = config.url[len("s3://") :]
    storage.fs.invalidate_cache()
    return sorted(key[len(root) + 1 :] for key in storage.fs.find(root))


@pytest.mark.parametrize("untagged", [False, True], ids=["tagged", "untagged"])
@pytest.mark.parametrize(("op", "name", "nth"), _KILL_POINTS)
def test_a_killed_delete_on_s3_leaves_the_id_whole_or_to_the_next_gc(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture, untagged: bool, op: str, name: str, nth: int
) -> None:
    config = _killed_delete(s3_server, untagged, op, name, nth)
    committed = _whole_or_absent(config)
    left_at_the_id = any(name.startswith("step_1/") for name in _left(config))
    if not committed:  # a user's file put into what the killed delete left at the id (or where it was)
        config.create_storage().write(Path("step_1/notes.txt"), b"mine")
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        report = collect_garbage(config.url, config.create_storage(), unowned_after_s=0)
    assert not report.failed and not report.kept, report
    assert _whole_or_absent(config) == committed
    if committed:
        assert _left(config) == ["step_1/manifest.json", "step_1/model_0.pt", "step_1/x_0.pt"], _left(config)
        return
    assert _left(config) == ["step_1/notes.txt"], _left(config)  # gc finished the delete, the user's file kept
    assert config.create_storage().read(Path("step_1/notes.txt")) == b"mine"
    if left_at_the_id:  # named beside what gc removed there
        assert "step_1/notes.txt" in caplog.text, caplog.text
