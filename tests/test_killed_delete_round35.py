"""A delete of a committed checkpoint SIGKILLed at each of its steps, on `file://` (fsspec: no rename, so the
move to the trash is a copy, then a delete of the id's files).

Before, the id's committed manifest went first: killed then, the id held the checkpoint's files with no manifest
and no marker. Nothing listed or loaded it, but gc did not name them, nothing told the operator, and every later
save of the id was refused ("a directory that is not a checkpoint"). The trash's own removal, killed past its
manifest, left a trash folder gc kept as "not ours" for a person to delete. Now the delete first puts up its
claim (the `.incomplete` marker gc reads), naming the save whose manifest it deletes, and the manifest goes after
the files it lists: at every kill point the id is whole and loads exactly, or does not list or load, and the next
gc removes what is left of ours, never a user's file (`notes.txt` put in the folder after the kill), which it names.

Real processes killed with SIGKILL at a chosen file operation, on real files.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE

import pytest
import torch

from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import _CHILD_TIMEOUT_S, REPO, _env, _plain_manager, _run_until_sigkilled
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import CheckpointError, CommitError
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")

_CHILD = r"""
import os, signal, sys, torch
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import delete_checkpoint

url, ckpt, op, name, nth = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
seen = []

def _at(kind, path):
    if kind == op and os.path.basename(path) == name:
        seen.append(path)
        if len(seen) == nth:
            os.kill(os.getpid(), signal.SIGKILL)

class KilledAt(LocalFileSystem):
    # SIGKILLed at the `nth` removal (rm) or copy (cp) of a file named `name`: no cleanup, no handler.
    def rm_file(self, path):
        _at("rm", path)
        return super().rm_file(path)

    def cp_file(self, path1, path2, **kwargs):
        _at("cp", path1)
        return super().cp_file(path1, path2, **kwargs)

config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
with CheckpointManager(config) as manager:
    manager.save(ckpt, {"model": {"w": torch.arange(4.0)}, "x": 1})
delete_checkpoint(ckpt, FsspecStorageConfig(url=url, filesystem=KilledAt()).create_storage())
"""

# (operation, file name, which one of that name): the copy to the trash, the removal of the id's files (the
# first removals of each name), the removal of the trash's (the second).
_KILL_POINTS = [
    ("cp", "model_0.pt", 1),
    ("cp", "manifest.json", 1),
    ("rm", "model_0.pt", 1),
    ("rm", "x_0.pt", 1),
    ("rm", "manifest.json", 1),
    ("rm", ".incomplete", 1),
    ("rm", "model_0.pt", 2),
    ("rm", "manifest.json", 2),
    ("rm", ".incomplete", 2),
]


def _whole_or_absent(url: str, ckpt: str, w: torch.Tensor | None = None, x: int = 1) -> None:
    """The id is a committed checkpoint that loads exactly (`w`, default `arange(4.0)`, and `x`), or it neither
    lists nor loads."""
    w = torch.arange(4.0) if w is None else w
    storage = FsspecStorageConfig(url=url).create_storage()
    listed = [Path(info.path).name for info in list_checkpoints(url, storage)]
    with _plain_manager(url) as manager:
        if listed == [ckpt]:
            state = manager.load(ckpt)
            assert torch.equal(state["model"]["w"], w) and state["x"] == x, state
            return
        assert listed == [], listed
        with pytest.raises((CheckpointError, FileNotFoundError)):
            manager.load(ckpt)


def _ours_left(run: Path) -> list[str]:
    """What is under the run's root besides the user's `notes.txt`."""
    return sorted(
        os.path.relpath(os.path.join(where, name), run)
        for where, _, files in os.walk(run)
        for name in files
        if name != "notes.txt"
    )


@pytest.mark.parametrize(("op", "name", "nth"), _KILL_POINTS)
def test_a_killed_delete_leaves_the_id_whole_or_to_the_next_gc(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, op: str, name: str, nth: int
) -> None:
    url, ckpt = _root_url("file", tmp_path), "step_1"
    run = tmp_path / "run"
    _run_until_sigkilled(_CHILD, url, ckpt, op, name, str(nth))
    _whole_or_absent(url, ckpt)
    storage = FsspecStorageConfig(url=url).create_storage()
    committed = bool(list_checkpoints(url, storage))
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        report = collect_garbage(url, storage, unowned_after_s=0)
    assert not report.failed, report
    assert not report.kept, report.kept
    _whole_or_absent(url, ckpt)
    if committed:
        assert _ours_left(run) == ["step_1/manifest.json", "step_1/model_0.pt", "step_1/x_0.pt"], _ours_left(run)
        return
    assert _ours_left(run) == [], _ours_left(run)  # gc finished the delete
    with _plain_manager(url) as manager:  # and the id is free again
        manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
    assert [Path(info.path).name for info in list_checkpoints(url, storage)] == [ckpt]


@pytest.mark.parametrize(("op", "name", "nth"), [("rm", "model_0.pt", 1), ("rm", "x_0.pt", 1)])
def test_a_users_file_put_where_a_delete_was_killed_survives_gc_and_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, op: str, name: str, nth: int
) -> None:
    url, ckpt = _root_url("file", tmp_path), "step_1"
    run = tmp_path / "run"
    _run_until_sigkilled(_CHILD, url, ckpt, op, name, str(nth))
    (run / ckpt).mkdir(exist_ok=True)
    (run / ckpt / "notes.txt").write_text("mine")
    storage = FsspecStorageConfig(url=url).create_storage()
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        report = collect_garbage(url, storage, unowned_after_s=0)
    assert (run / ckpt / "notes.txt").read_text() == "mine"
    assert _ours_left(run) == [], _ours_left(run)
    assert "notes.txt" in caplog.text, (report, caplog.text)
    assert not list_checkpoints(url, storage)


def test_a_save_of_the_id_a_killed_delete_left_says_what_is_there_and_the_fix(tmp_path: Path) -> None:
    """The killed delete left its claim beside the manifest and some of the files. Before, a save of the id was
    refused as if a whole checkpoint were there: "a checkpoint already exists there, and this storage cannot
    replace one atomically ... Delete it first", though nothing there lists or loads. Now the refusal says it is
    an unfinished save or delete and names gc; after that gc, the save commits."""
    url, ckpt = _root_url("file", tmp_path), "step_1"
    _run_until_sigkilled(_CHILD, url, ckpt, "rm", "model_0.pt", "1")
    with _plain_manager(url) as manager, pytest.raises(CommitError, match=r"unfinished .*torch-checkpointing gc"):
        manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
    storage = FsspecStorageConfig(url=url).create_storage()
    assert not collect_garbage(url, storage, unowned_after_s=0).failed
    with _plain_manager(url) as manager:
        manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
        assert torch.equal(manager.load(ckpt)["model"]["w"], torch.arange(3.0))


_RACER = r"""
import json, os, sys, time, torch
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy, prune

what, url, go = sys.argv[1:4]
storage = FsspecStorageConfig(url=url).create_storage()
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:  # all start together
    time.sleep(0.001)
if what == "prune":
    report = prune(url, RetentionPolicy(keep_last=2), storage)
    print(json.dumps({"deleted": [c.name for c in report.deleted], "failed": [w for _, w in report.failed]}))
else:
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
    with CheckpointManager(config) as manager:
        manager.save(what, {"model": {"w": torch.full((4,), 9.0)}, "x": 9})
    print(json.dumps({"saved": what}))
"""


def test_two_prunes_and_a_save_of_a_new_id_at_once_touch_nothing_but_the_pruned(tmp_path: Path) -> None:
    """Two processes prune one `file://` root (keep_last=2) while a third saves a new id: each pruned checkpoint
    is deleted by one of them (the other finds it gone or being deleted: no failure), the kept ones and the new
    save load exactly, and gc finds nothing left."""
    url = _root_url("file", tmp_path)
    with _plain_manager(url) as manager:
        for step in range(1, 7):
            manager.save(f"step_{step}", {"model": {"w": torch.full((4,), float(step))}, "x": step})
    go = tmp_path / "go"
    racers = [
        subprocess.Popen([sys.executable, "-c", _RACER, what, url, str(go)], cwd=REPO, env=_env(), stdout=PIPE)
        for what in ("prune", "prune", "step_9")
    ]
    time.sleep(1.0)  # the children import meanwhile; only then are they let go at once
    go.touch()
    outs = [json.loads(racer.communicate(timeout=_CHILD_TIMEOUT_S)[0]) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0, 0], outs
    deleted = outs[0]["deleted"] + outs[1]["deleted"]
    assert not outs[0]["failed"] and not outs[1]["failed"], outs
    assert len(deleted) == len(set(deleted)) and {"step_1", "step_2", "step_3", "step_4"} <= set(deleted), outs
    storage = FsspecStorageConfig(url=url).create_storage()
    listed = sorted(Path(info.path).name for info in list_checkpoints(url, storage))
    assert listed == sorted({"step_5", "step_6", "step_9"} - set(deleted)), (listed, outs)
    with _plain_manager(url) as manager:
        for name in listed:
            state = manager.load(name)
            assert torch.equal(state["model"]["w"], torch.full((4,), float(state["x"]))), name
    report = collect_garbage(url, storage, unowned_after_s=0)
    assert not (report.removed or report.kept or report.failed), report
