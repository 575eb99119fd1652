"""A delete by the id (`FsspecStorage.rmdir`, no rename before it) of a checkpoint that other processes delete
and save again between the delete's listing of the id and its claim.

The delete listed the first checkpoint's files, then put its claim up over the second one (the id was free of
claims once that save committed) and removed the names it had listed: those it shares with the second save, the
second's manifest after them, the marker last. The second save's other files stayed at the id with no manifest
and no marker (a folder that every later save of the id refuses, and gc never names), and the delete failed on
a bare "Directory not empty". The move of a checkpoint to a trash name had this guarded (the manifest it read
before its copy must still be the one at the id, `_same_as_copied`); a plain delete now reads the manifest before
it lists and is held to it the same way: the second checkpoint is left whole, and the delete says why.

Real processes on real files, and against a real S3 API server (the same race on an object store): the
delete runs in a child, held right after its listing; another process deletes the checkpoint, a third saves it
again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_server import S3Server, missing_s3_packages
from tests.test_objstore_round22 import REPO, _env
from tests.test_s3_attacks import sync_manager
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")

# rmdir of the checkpoint, held right after it listed the id: it touches `held`, then waits for `release`.
# Prints REMOVED, or REFUSED and the error.
_HELD_DELETE = r"""
import json, os, sys, time
from pathlib import Path
from torch_checkpointing import FsspecStorageConfig

a = json.loads(sys.argv[1])
flags = Path(a["flags"])

def hold(path):
    if os.path.basename(path.rstrip("/")) == a["id"] and not (flags / "held").exists():
        (flags / "held").touch()
        while not (flags / "release").exists():
            time.sleep(0.02)

if a["options"]:
    import s3fs

    fs = s3fs.S3FileSystem(**a["options"])
else:
    from fsspec.implementations.local import LocalFileSystem

    fs = LocalFileSystem()
listed = fs.find

def find(path, *args, **kwargs):
    out = listed(path, *args, **kwargs)
    hold(path)
    return out

fs.find = find
config = FsspecStorageConfig(url=a["url"], filesystem=fs)
try:
    config.create_storage().rmdir(Path(a["id"]))
    print("REMOVED")
except Exception as exc:  # the store's error, naming why
    print("REFUSED", exc)
"""

_SAVE = r"""
import json, sys, torch
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
a = json.loads(sys.argv[1])
storage = FsspecStorageConfig(url=a["url"], storage_options=a["options"])
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage)
with CheckpointManager(config) as manager:
    manager.save(a["id"], {"model": {"w": torch.arange(3.0)}, "x": 3})
"""

_DELETE = r"""
import json, sys
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.retention import delete_checkpoint
a = json.loads(sys.argv[1])
storage = FsspecStorageConfig(url=a["url"], storage_options=a["options"]).create_storage()
assert delete_checkpoint(a["id"], storage)
"""


def _run(script: str, args: dict[str, Any]) -> None:
    subprocess.run([sys.executable, "-c", script, json.dumps(args)], cwd=REPO, env=_env(), check=True, timeout=180)


def _wait_for(flag: Path, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while not flag.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the delete never listed the id"
        time.sleep(0.02)


def _files(config: FsspecStorageConfig) -> list[str]:
    """Every file (object) under the run's root, relative to it."""
    fs = config.create_storage().fs
    root = config.url.split("://", 1)[1]
    fs.invalidate_cache()
    return sorted(name[len(root) + 1 :] for name in fs.find(root))


@pytest.mark.parametrize("store", ["file", "s3"])
def test_a_delete_by_the_id_leaves_a_checkpoint_saved_after_its_listing_whole(
    tmp_path: Path, request: pytest.FixtureRequest, store: str
) -> None:
    """Defect: the delete removed `model_0.pt` and the manifest of the second save, leaving its `x_0.pt` alone at
    the id (no manifest, no marker); on `file://` it then failed on "Directory not empty"."""
    if store == "s3":
        if missing_s3_packages():
            pytest.skip("needs the s3 extra")
        server: S3Server = request.getfixturevalue("s3_server")
        config = FsspecStorageConfig(url=f"{server.config().url}/run", storage_options=server.storage_options())
    else:
        config = FsspecStorageConfig(url=f"file://{tmp_path}/run")
    with sync_manager(config) as manager:
        manager.save("step_1", {"model": {"w": torch.arange(4.0)}})  # model_0.pt; the second adds x_0.pt
    flags = tmp_path / "flags"
    flags.mkdir()
    args = {"url": config.url, "options": config.storage_options, "id": "step_1", "flags": str(flags)}
    child = subprocess.Popen(
        [sys.executable, "-c", _HELD_DELETE, json.dumps(args)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_for(flags / "held", child)
        _run(_DELETE, args)
        _run(_SAVE, args)
    finally:
        (flags / "release").touch()
        out, err = child.communicate(timeout=180)
    said, left = out.decode(), _files(config)
    assert said.startswith("REFUSED") and "saved again" in said, (said, err.decode()[-2000:], left)
    storage = config.create_storage()
    assert [Path(i.path).name for i in list_checkpoints(config.url, storage)] == ["step_1"], left
    with sync_manager(config) as manager:
        state = manager.load("step_1")
    assert torch.equal(state["model"]["w"], torch.arange(3.0)) and state["x"] == 3
    report = collect_garbage(config.url, storage, unowned_after_s=0)
    assert not report.failed and not report.kept and not report.removed, report
    assert _files(config) == left
