"""Round 21: the failed-save cleanup on object stores that record no writer per object (fsspec `memory://`, a
local directory through fsspec `file://`, and GCS / Azure the same way), and the names messages give them.

* A failed save's cleanup, and gc of a killed save's prefix, deleted everything under the claimed prefix there:
  also the files a user or another program put there while the save ran (an eval job's results, a note). Only
  S3 recorded which save wrote an object. Every rank now records the names it is about to write (a small
  record beside the marker, written before its first upload), and the cleanup removes only those names, the
  records, this save's own manifest and, last, the marker; what else is there stays and is named at WARNING.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, FsspecStorageConfig, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.commit import Claim
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import IncompleteCheckpointError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.fsspec_storage import FsspecStorage

pytest.importorskip("fsspec")

REPO = Path(__file__).resolve().parent.parent
_CHILD_TIMEOUT_S = 120

USER = {"eval/results.json": b'{"acc": 0.9}', "NOTES.txt": b"do not delete"}


def _dead_pid() -> int:
    """The pid of a process that has ended (a claim made by it is provably dead on this host)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    return int(done.stdout)


def _root_url(store: str, tmp_path: Path) -> str:
    return f"memory://r21-{uuid.uuid4().hex[:8]}/run" if store == "memory" else f"file://{tmp_path}/run"


def _state() -> dict[str, Any]:
    # Three items in three files, the model's in a directory of its own (`_ITEMS`): the save writes files and a
    # directory besides the marker, and the user's `eval/` is a directory too.
    return {"model": {"w": torch.arange(6.0)}, "optim": {"lr": 0.1}, "x": 1}


_ITEMS = {"model": ItemSpec(layout=LayoutInfo("rank_{rank}/model.safetensors", SafetensorsSerialization()))}


def _manager(url: str, callback: Any = None, items: dict[str, ItemSpec] = _ITEMS) -> CheckpointManager:
    config = CheckpointManager.Config(
        items=items, save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url)
    )
    config.pre_finalize_callback = callback
    return CheckpointManager(config)


def _entries(storage: FsspecStorage, ckpt: str) -> tuple[set[str], set[str]]:
    """The files and the directories under the checkpoint's prefix, relative to it."""
    backend, key = storage._resolve(Path(ckpt))
    key = "/" + key.lstrip("/")  # as the directory store's listing names it
    if not backend.fs.exists(key):
        return set(), set()
    found = backend.fs.find(key, withdirs=True, detail=True)
    rel = {name[len(key) + 1 :]: info["type"] for name, info in found.items() if name != key}
    return {r for r, t in rel.items() if t != "directory"}, {r for r, t in rel.items() if t == "directory"}


def _assert_only_users_left(storage: FsspecStorage, ckpt: str, log: str) -> None:
    files, dirs = _entries(storage, ckpt)
    assert files == set(USER), files  # the save's own files and its marker are gone, the user's are all there
    for rel, data in USER.items():
        assert storage.read(Path(ckpt) / rel) == data, rel
        assert f"{ckpt}/{rel}" in log, (rel, log)  # named at WARNING, as left in place
    users_dirs = {posixpath.dirname(rel) for rel in USER} - {""}
    assert dirs <= users_dirs, dirs  # no empty directory of the save is left either


def _put_users_files(storage: FsspecStorage, ckpt: str) -> None:
    for rel, data in USER.items():
        storage.mkdir((Path(ckpt) / rel).parent)  # a directory on file://, nothing on an object store
        storage.write(Path(ckpt) / rel, data)


class _PutsUserFilesThenFails:
    """A pre_finalize_callback: while the save's files are up and its claim held, a user puts files under the
    checkpoint's prefix; then the save fails (the callback raises), before any manifest."""

    def __init__(self, url: str) -> None:
        self.storage = FsspecStorageConfig(url=url).create_storage()

    def __call__(self, checkpoint_id: str, _: Any) -> None:
        _put_users_files(self.storage, checkpoint_id)
        raise RuntimeError("the pre-commit check failed")


@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_failed_save_removes_only_what_it_wrote(store: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    url = _root_url(store, tmp_path)
    ckpt = "step_1"
    callback = _PutsUserFilesThenFails(url)
    with _manager(url, callback) as manager, pytest.raises(RuntimeError, match="pre-commit check"):
        manager.save(ckpt, _state())
    _assert_only_users_left(callback.storage, ckpt, caplog.text)


# ------------------------------------------------------------------------------- gc of a killed save's prefix

_KILLED_SAVE_CHILD = r"""
import json, os, signal, sys, torch
from pathlib import Path
from torch_checkpointing import CheckpointManager, FsspecStorageConfig, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.commit import Claim
from torch_checkpointing.config import SyncCheckpointSaverConfig

a = json.loads(sys.argv[1])
plain = FsspecStorageConfig(url=a["url"]).create_storage()

def killed(checkpoint_id, _):
    for rel, data in a["user"].items():
        plain.mkdir((Path(checkpoint_id) / rel).parent)
        plain.write(Path(checkpoint_id) / rel, data.encode())
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all

from tests.test_objstore_round21 import _ITEMS
config = CheckpointManager.Config(
    items=_ITEMS, save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=a["url"])
)
config.pre_finalize_callback = killed
with CheckpointManager(config) as m:
    m.save(a["id"], {"model": {"w": torch.arange(6.0)}, "optim": {"lr": 0.1}, "x": 1})
"""


def test_gc_of_a_killed_saves_prefix_removes_only_what_that_save_wrote(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer is SIGKILLed mid-save (file:// through fsspec: a store without rename that outlives the
    process); gc collects its prefix once its claim is dead, and left the user's files alone."""
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    url, ckpt = _root_url("file", tmp_path), "step_3"
    args = {"url": url, "id": ckpt, "user": {rel: data.decode() for rel, data in USER.items()}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE_CHILD, json.dumps(args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=_CHILD_TIMEOUT_S,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode(errors="replace")[-3000:]
    storage = FsspecStorageConfig(url=url).create_storage()
    assert storage.exists(Path(ckpt) / INCOMPLETE_MARKER)  # killed: nothing cleaned up
    assert len(_entries(storage, ckpt)[0]) > len(USER) + 1  # the save's own files are there too
    caplog.set_level(logging.INFO, logger="torch_checkpointing")
    collect_garbage(url, storage, unowned_after_s=0)
    _assert_only_users_left(storage, ckpt, caplog.text)
    assert f"gc removed the unfinished save at {url}/{ckpt} " in caplog.text, caplog.text  # `file:///abs/...`


def test_gc_of_a_dead_saves_prefix_in_memory_removes_only_what_that_save_wrote(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """memory:// lives in one process, so the killed save is rebuilt: what its prefix held when the user's files
    landed (taken from the store, not forged) is put back once its job is over; its claim is then dead."""
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    url, ckpt = _root_url("memory", Path()), "step_4"
    storage = FsspecStorageConfig(url=url).create_storage()
    backend, key = storage._resolve(Path(ckpt))
    snapshot: dict[str, bytes] = {}

    def snapshot_then_fail(checkpoint_id: str, _: Any) -> None:
        _put_users_files(storage, checkpoint_id)
        snapshot.update({name: backend.fs.cat_file(name) for name in backend.fs.find(key)})
        raise RuntimeError("the pre-commit check failed")

    with _manager(url, snapshot_then_fail) as manager, pytest.raises(RuntimeError):
        manager.save(ckpt, _state())
    for name, data in snapshot.items():  # as a SIGKILL would have left it: no cleanup ran
        backend.fs.pipe_file(name, data)
    # Its process is this one, alive: the claim is made that of a process that has ended, as a kill leaves it.
    marker = Path(ckpt) / INCOMPLETE_MARKER
    claim = Claim.parse(storage.read(marker))
    assert claim is not None
    storage.delete(marker)
    storage.write(marker, dataclasses.replace(claim, uid="", pid=_dead_pid()).to_bytes())
    assert storage.exists(Path(ckpt) / INCOMPLETE_MARKER)
    caplog.clear()
    collect_garbage(url, storage, unowned_after_s=0)
    _assert_only_users_left(storage, ckpt, caplog.text)


@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_committed_save_keeps_no_record_and_loads(store: str, tmp_path: Path) -> None:
    """The records of what the ranks write go before the marker: a committed checkpoint holds its files alone
    (a record left there would be a file its manifest does not list, and retention would refuse to delete it)."""
    url = _root_url(store, tmp_path)
    with _manager(url) as manager:
        manager.save("step_5", _state())
        assert torch.equal(manager.load("step_5")["model"]["w"], torch.arange(6.0))
    storage = FsspecStorageConfig(url=url).create_storage()
    files, _ = _entries(storage, "step_5")
    assert not [name for name in files if name.startswith(INCOMPLETE_MARKER)], files
    assert "manifest.json" in files


# ------------------------------------------------------------------------------- two ranks, one store

_RANKS_TIMEOUT_S = 240.0


def two_ranks_save_failing_on_rank_1(url: str, ckpt: str) -> dict[str, Any]:
    """Both ranks write their files; rank 1's pre-commit check puts the user's files there and fails: rank 0
    cleans up, and must find rank 1's file names in rank 1's record (its plan names only its own)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    callback = _PutsUserFilesThenFails(url) if rank == 1 else None
    try:
        with _manager(url, callback) as manager:
            manager.save(ckpt, {"model": {"w": torch.full((8,), float(rank))}, "x": rank})
    except Exception as exc:
        return {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    return {"rank": rank, "error": ""}


@pytest.mark.multirank
def test_a_failed_two_rank_save_removes_every_ranks_files_and_only_those(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from simulator.launcher import launch

    url, ckpt = _root_url("file", tmp_path), "step_6"
    reports = launch(two_ranks_save_failing_on_rank_1, 2, args=(url, ckpt), timeout=_RANKS_TIMEOUT_S)
    assert all(report["error"] for report in reports), reports  # the save failed on every rank
    storage = FsspecStorageConfig(url=url).create_storage()
    files, dirs = _entries(storage, ckpt)
    assert files == set(USER), files  # rank 0 removed rank 1's files too, and left the user's
    assert dirs <= {"eval"}, dirs


# ------------------------------------------------------------------------------- what messages name


def test_messages_name_a_memory_checkpoint_by_the_url_a_user_passes(caplog: pytest.LogCaptureFixture) -> None:
    """Messages named a memory:// checkpoint `memory:////root/run/step_7` (a relative id joined to the root kept
    a doubled leading slash), or by its bare id: neither is what `load` or the CLI are given. A save's message
    and a load's now name `memory://root/run/step_7`."""
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    url = _root_url("memory", Path())
    ckpt, full = "step_7", f"{url}/step_7"
    callback = _PutsUserFilesThenFails(url)
    with _manager(url, callback) as manager, pytest.raises(RuntimeError):
        manager.save(ckpt, _state())
    assert f"The failed save of {full} removed" in caplog.text, caplog.text
    assert f"{full}/NOTES.txt" in caplog.text, caplog.text
    assert callback.storage.remap_path(Path(ckpt)) == full
    callback.storage.write(Path(ckpt) / INCOMPLETE_MARKER, b"")  # a delete of it under way
    with _manager(url) as manager, pytest.raises(IncompleteCheckpointError) as refused:
        manager.load(ckpt)
    assert f"Checkpoint {full} is incomplete" in str(refused.value), refused.value
    assert ":////" not in caplog.text + str(refused.value)


def test_a_file_url_keeps_its_absolute_path_in_messages(tmp_path: Path) -> None:
    """A local directory through fsspec is named `file:///abs/path`, the URL fsspec and the CLI take."""
    storage = FsspecStorageConfig(url=f"file://{tmp_path}/run").create_storage()
    assert storage.remap_path(Path("step_1")) == f"file://{tmp_path}/run/step_1"
    assert storage.remap_path(Path(f"file://{tmp_path}/run/step_1")) == f"file://{tmp_path}/run/step_1"


def test_a_loads_refusals_name_a_memory_checkpoint_by_its_url() -> None:
    """A load of a missing id, and of a prefix without a manifest, named the bare id (`step_8`), by the
    self-describing route (no items configured) and through the configured items alike."""
    url = _root_url("memory", Path())
    storage = FsspecStorageConfig(url=url).create_storage()
    storage.write(Path("step_9/notes.txt"), b"not a checkpoint")
    for items, no_manifest in (({}, f"{url}/step_9: no manifest.json"), (_ITEMS, f"{url}/step_9 has no manifest")):
        with _manager(url, items=items) as manager:
            with pytest.raises(FileNotFoundError) as missing:
                manager.load("step_8")
            assert f"Checkpoint path {url}/step_8 does not exist." in str(missing.value), missing.value
            with pytest.raises(IncompleteCheckpointError) as not_one:
                manager.load("step_9")
            assert no_manifest in str(not_one.value), not_one.value


def test_gc_of_a_save_killed_between_its_manifest_and_its_marker_removes_what_the_manifest_lists(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Killed after writing its manifest and dropping its records, before removing its marker: the manifest is
    what names the save's files then (the claim's own token is in it), and the user's file still stays."""
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    url, ckpt = _root_url("memory", Path()), "step_10"
    storage = FsspecStorageConfig(url=url).create_storage()
    with _manager(url) as manager:
        manager.save(ckpt, _state())
    manifest = json.loads(storage.read(Path(ckpt) / "manifest.json"))
    files, _ = _entries(storage, ckpt)
    dead = Claim(manifest["claim"], "", socket.gethostname(), _dead_pid(), time.time(), records=True)
    storage.write(Path(ckpt) / INCOMPLETE_MARKER, dead.to_bytes())  # as the kill left it
    _put_users_files(storage, ckpt)
    collect_garbage(url, storage, unowned_after_s=0)
    _assert_only_users_left(storage, ckpt, caplog.text)
    assert files - {"manifest.json"}, files  # the checkpoint had files of its own, and they went
