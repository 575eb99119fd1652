"""Round 22 review: what a dead save's records beside its claim can make a cleanup delete, off S3 (fsspec
`file://`), where the records name the files to remove.

* A symbolic link under a dead save's prefix (a user's `eval -> /data/eval`) was walked into: fsspec follows
  links, and only a store with local paths was checked for one. A record naming `link/secret.txt` (crafted, or a
  save's name whose directory a user replaced by a link) made gc, and a save taking the dead claim over, delete
  the user's file outside the prefix, through the link.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from tests.probes import stop
from tests.s3_server import S3Server
from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import (
    _CHILD_TIMEOUT_S,
    REPO,
    _assert_loads_whole,
    _commit_error,
    _env,
    _killed_save,
    _paused_gc,
    _plain_manager,
    _run_until_sigkilled,
    _wait_for,
)
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.commit import Claim
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import IncompleteCheckpointError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")

_CRAFTED_RECORD = f"{INCOMPLETE_MARKER}.0123456789abcdef.0"  # a record's name, of no save that ran


def _link_out_of_the_prefix(tmp_path: Path, ckpt: str) -> Path:
    """A user's directory outside the run, linked into the dead save's prefix as `link`, and a record naming
    the file in it as if the save had written `link/secret.txt`. Returns the user's file."""
    outside = tmp_path / "users_data"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_bytes(b"the user's, outside the checkpoint")
    prefix = tmp_path / "run" / ckpt
    os.symlink(outside, prefix / "link")
    record = {"token": "crafted", "rank": 0, "files": ["link/secret.txt"]}
    (prefix / _CRAFTED_RECORD).write_text(json.dumps(record))
    return secret


def test_gc_of_a_dead_saves_prefix_never_deletes_through_a_link_in_it(tmp_path: Path) -> None:
    """Before: gc deleted `users_data/secret.txt` (outside the run) through the link, then failed on removing
    the link as a directory. Now the link is an entry gc does not walk into: the user's file stays, the dead
    save's own files go."""
    url, ckpt = _root_url("file", tmp_path), "step_1"
    _killed_save(url, ckpt, user={})
    secret = _link_out_of_the_prefix(tmp_path, ckpt)
    report = collect_garbage(url, FsspecStorageConfig(url=url).create_storage(), unowned_after_s=0)
    assert secret.read_bytes() == b"the user's, outside the checkpoint"
    assert report.removed and not report.failed, report
    assert sorted(os.listdir(tmp_path / "run" / ckpt)) == ["link"]  # the user's link stays, the save's files went


def test_a_save_taking_a_dead_claim_over_never_deletes_through_a_link_in_its_prefix(tmp_path: Path) -> None:
    """The same at the commit of a save that took the killed save's claim over (`_remove_taken_over`)."""
    url, ckpt = _root_url("file", tmp_path), "step_2"
    _killed_save(url, ckpt, user={})
    secret = _link_out_of_the_prefix(tmp_path, ckpt)
    try:
        with _plain_manager(url) as manager:
            manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
    finally:
        assert secret.read_bytes() == b"the user's, outside the checkpoint"
    assert not (tmp_path / "run" / ckpt / "optim_0.pt").exists()  # the dead save's own files went


# ------------------------------------------------------------------ a gc killed while it holds a dead save's id

_KILLED_AT_CHILD = r"""
import os, signal, sys, torch
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import collect_garbage

what, url, ckpt, kill_at = sys.argv[1:5]

class KilledAtOneDelete(LocalFileSystem):
    # The process is SIGKILLed as it deletes the file named `kill_at`: no cleanup, no handler.
    def rm_file(self, path):
        if os.path.basename(path) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().rm_file(path)

storage = FsspecStorageConfig(url=url, filesystem=KilledAtOneDelete()).create_storage()
if what == "save":
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url, filesystem=KilledAtOneDelete())
    )
    with CheckpointManager(config) as manager:
        manager.save(ckpt, {"model": {"w": torch.arange(4.0)}, "x": 1})
else:
    collect_garbage(url, storage, unowned_after_s=0)
"""


def _killed_at(what: str, url: str, ckpt: str, kill_at: str) -> None:
    _run_until_sigkilled(_KILLED_AT_CHILD, what, url, ckpt, kill_at)


def test_a_gc_killed_holding_a_dead_saves_id_never_makes_that_save_a_checkpoint(tmp_path: Path) -> None:
    """The save is SIGKILLed as it removes its marker (its manifest written: not committed); gc is SIGKILLed
    after it put its own claim in the marker, as it deletes that manifest. Before, gc's claim beside the manifest
    read as another save's stray claim: the killed save listed and loaded as a committed checkpoint, and the
    next gc let go of gc's claim and left it so for good. Now gc's claim names the save it collects: the id
    stays incomplete, and the next gc removes it whole."""
    url, ckpt = _root_url("file", tmp_path), "step_3"
    storage = FsspecStorageConfig(url=url).create_storage()
    _killed_at("save", url, ckpt, INCOMPLETE_MARKER)
    prefix = tmp_path / "run" / ckpt
    assert {"manifest.json", INCOMPLETE_MARKER} <= set(os.listdir(prefix)), os.listdir(prefix)
    assert not list_checkpoints(url, storage)  # the killed save: not committed
    _killed_at("gc", url, ckpt, "manifest.json")
    held = Claim.parse((prefix / INCOMPLETE_MARKER).read_bytes())
    assert held is not None and held.token.startswith("gc-"), held  # gc was killed holding the id
    assert not list_checkpoints(url, storage)
    with _plain_manager(url) as manager, pytest.raises(IncompleteCheckpointError):
        manager.load(ckpt)
    report = collect_garbage(url, storage, unowned_after_s=0)
    assert not report.failed, report
    assert not list_checkpoints(url, storage)
    assert not prefix.exists() or not os.listdir(prefix), os.listdir(prefix)


# ------------------------------------------------------------------ a crafted record: huge

_GC_MEMORY_CHILD = r"""
import resource, sys
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.retention import collect_garbage

url = sys.argv[1]
storage = FsspecStorageConfig(url=url).create_storage()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report = collect_garbage(url, storage, unowned_after_s=0)
grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grown_kib, len(report.removed), len(report.failed))
"""


def test_gc_never_reads_a_huge_record_whole(tmp_path: Path) -> None:
    """A file named like a record beside a dead save's claim, 1 GiB (sparse: no disk). Before, gc read it whole
    (its peak memory grew by over 1 GiB) to find it was not JSON. Now a record is read as a manifest is, its size
    checked first against the manifest's limit: refused unread, named at WARNING, the dead save still removed."""
    url, ckpt = _root_url("file", tmp_path), "step_4"
    _killed_save(url, ckpt, user={})
    with open(tmp_path / "run" / ckpt / _CRAFTED_RECORD, "wb") as f:
        f.truncate(1 << 30)
    done = subprocess.run(
        [sys.executable, "-c", _GC_MEMORY_CHILD, url],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=_CHILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    grown_kib, removed, failed = (int(n) for n in done.stdout.split())
    assert grown_kib < 128 * 1024, f"gc's peak memory grew by {grown_kib} KiB"
    assert (removed, failed) == (1, 0), done.stderr.decode(errors="replace")[-3000:]
    assert _CRAFTED_RECORD in done.stderr.decode(errors="replace"), done.stderr  # named, as not one of ours
    assert os.listdir(tmp_path / "run" / ckpt) == [_CRAFTED_RECORD]  # not ours: left in place (round 33)


# ------------------------------------------------------------------ on S3: a checkpoint inside a dead save's prefix


def _nested_checkpoint_under_a_killed_save(s3_server: S3Server) -> tuple[FsspecStorageConfig, FsspecStorageConfig]:
    """A save of `a` SIGKILLed mid-save (its tagged objects and claim stay), then a checkpoint `b` committed by
    a manager whose root is `.../a` (its objects tagged with its own save's token). Returns (run, inner) configs."""
    config = s3_server.config()
    _killed_save(config.url, "a", user={}, env=s3_server.client_env())
    inner = dataclasses.replace(config, url=f"{config.url}/a")
    with _manager_on(inner) as manager:
        manager.save("b", {"w": torch.arange(5.0)})
    return config, inner


def _manager_on(config: FsspecStorageConfig) -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config))


def _assert_inner_loads(inner: FsspecStorageConfig) -> None:
    with _manager_on(inner) as manager:
        assert torch.equal(manager.load("b")["w"], torch.arange(5.0))


def test_on_s3_a_save_taking_a_dead_claim_over_never_deletes_a_checkpoint_inside_its_prefix(
    s3_server: S3Server,
) -> None:
    """Before, the save of `a` that took the killed save's claim over deleted, at its commit, every object under
    `a/` tagged by another save: the committed checkpoint `a/b`'s too (`manifest.json` and its file), so it no
    longer loaded. A sub-prefix holding a manifest or a marker of its own is another checkpoint (or save): left."""
    config, inner = _nested_checkpoint_under_a_killed_save(s3_server)
    with _manager_on(config) as manager:
        manager.save("a", {"model": {"w": torch.arange(3.0)}})
    _assert_inner_loads(inner)


def test_on_s3_gc_of_a_dead_saves_prefix_never_deletes_a_checkpoint_inside_it(s3_server: S3Server) -> None:
    """The same for gc of the killed save's prefix: every tagged object under `a/` went, `a/b`'s with them."""
    config, inner = _nested_checkpoint_under_a_killed_save(s3_server)
    report = collect_garbage(config.url, config.create_storage(), unowned_after_s=0)
    assert not report.failed, report
    _assert_inner_loads(inner)


# ------------------------------------------------------------------ off S3: a save and gc replace one dead claim


def test_a_save_and_gc_replacing_one_dead_claim_at_once_never_both_hold_it(tmp_path: Path) -> None:
    """gc (one process) judged a SIGKILLed save's claim dead and compared the marker; right then a new save of
    the id (this process) took the same claim over. Before, the compare and the delete were two steps: gc's
    delete removed the save's new claim and put its own there, both held the id, gc deleted the files the save
    had written so far, the save failed blaming storage the committing rank cannot read, and the file it wrote
    afterwards (`x_0.pt`) stayed with no marker: every later save of the id was refused, and gc never collected
    it. The marker's compare-and-act off S3 is now one step among processes (a lock on its directory): the
    save waits for gc, and commits a checkpoint that loads."""
    from tests.test_objstore_round21 import _state

    url, ckpt = _root_url("file", tmp_path), "step_5"
    _killed_save(url, ckpt, user={})
    paused, go = tmp_path / "paused", tmp_path / "go"
    gc = _paused_gc(url, INCOMPLETE_MARKER, paused, go)  # in its replace of the dead claim: compared, not deleted
    release = threading.Timer(3.0, go.touch)  # if the save cannot get as far as its last file meanwhile
    try:
        _wait_for(paused, gc)
        release.start()
        _GcGoesBeforeX.gc, _GcGoesBeforeX.go = gc, go
        saved = _commit_error(lambda: _manager_with_fs(url, _GcGoesBeforeX()), ckpt, _state())
        go.touch()
        _, err = gc.communicate(timeout=_CHILD_TIMEOUT_S)
    finally:
        release.cancel()
        go.touch()
        if gc.poll() is None:
            gc.kill()
            gc.wait()
    assert gc.returncode == 0, err.decode(errors="replace")[-3000:]
    prefix = tmp_path / "run" / ckpt
    assert saved is None, (saved, sorted(os.listdir(prefix)) if prefix.exists() else None)
    _assert_loads_whole(url, ckpt)


class _GcGoesBeforeX(LocalFileSystem):
    """The save's filesystem: right before it writes `x_0.pt` (its last file), gc goes on and runs to its end."""

    gc: subprocess.Popen[bytes] | None = None
    go: Path | None = None

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if os.path.basename(path) == "x_0.pt" and "w" in mode and self.go is not None and not self.go.exists():
            self.go.touch()
            assert self.gc is not None
            self.gc.wait(timeout=_CHILD_TIMEOUT_S)
        return super()._open(path, mode, **kwargs)


def _manager_with_fs(url: str, fs: LocalFileSystem) -> CheckpointManager:
    from tests.test_objstore_round21 import _ITEMS

    config = CheckpointManager.Config(
        items=_ITEMS, save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url, filesystem=fs)
    )
    return CheckpointManager(config)


def test_a_process_stopped_inside_a_markers_compare_and_delete_never_hangs_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc is SIGSTOPped holding the marker's lock (inside its replace of a dead claim): a save's conditional
    delete of that marker gives up with an ObjectStoreError naming the marker, instead of waiting for ever."""
    from torch_checkpointing.errors import ObjectStoreError
    from torch_checkpointing.storage import fsspec_storage

    monkeypatch.setattr(fsspec_storage, "_MARKER_LOCK_WAIT_S", 1.0)
    url, ckpt = _root_url("file", tmp_path), "step_6"
    _killed_save(url, ckpt, user={})
    paused, go = tmp_path / "paused", tmp_path / "go"
    gc = _paused_gc(url, INCOMPLETE_MARKER, paused, go)  # in its replace of the dead claim: compared, not deleted
    try:
        _wait_for(paused, gc)
        stop(gc.pid)
        storage = FsspecStorageConfig(url=url).create_storage()
        marker = Path(ckpt) / INCOMPLETE_MARKER
        found = storage.read_object(marker)
        assert found is not None
        with pytest.raises(ObjectStoreError, match="stayed locked") as refused:
            storage.delete_object(marker, found[1])
        assert f"{url}/{ckpt}/{INCOMPLETE_MARKER}" in str(refused.value), refused.value
        assert storage.read_object(marker) == found  # nothing was changed
    finally:
        os.kill(gc.pid, signal.SIGCONT)
        go.touch()
        gc.communicate(timeout=_CHILD_TIMEOUT_S)


def test_a_filesystem_without_flock_keeps_the_two_steps_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An NFS mount without lock support answers flock with ENOLCK: the marker's replace and delete still work
    (two steps, as before the lock), and a WARNING says once what that leaves open."""
    import errno
    import fcntl

    from torch_checkpointing.storage import fsspec_storage

    def no_lock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_lock)
    monkeypatch.setattr(fsspec_storage, "_told_no_flock", [])
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    storage = FsspecStorageConfig(url=_root_url("file", tmp_path)).create_storage()
    marker = Path("step_7") / INCOMPLETE_MARKER
    storage.mkdir(marker.parent)
    assert storage.create_object(marker, b'{"claim": "dead"}')
    judged = storage.read_object(marker)
    assert judged is not None
    assert storage.replace_object(marker, b'{"claim": "new"}', judged[1])
    assert not storage.delete_object(marker, judged[1])
    current = storage.read_object(marker)
    assert current is not None and storage.delete_object(marker, current[1])
    assert caplog.text.count("takes no lock on a directory") == 1, caplog.text
