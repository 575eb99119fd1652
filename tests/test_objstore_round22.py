"""Round 22: object stores that record no writer per object (fsspec `file://`, `memory://`; GCS and Azure the
same way), where a save's ranks name what they write in records beside its claim (round 21).

* A save that took over the claim of a killed save of the same id committed with the killed save's records
  and files still under it: files its manifest does not list, which nothing ever deleted (the marker, which
  gc looks for, was gone once the new save committed).
* gc of a dead save's prefix listed the names to delete, a save took the dead claim over and committed the same
  names, and gc's deletes went on: the committed checkpoint lost files. gc now holds the id with its own claim.
* Off S3 a marker's conditional replace and delete ignored the version they were given.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_server import S3Server
from tests.test_objstore_round21 import _KILLED_SAVE_CHILD, USER, _dead_pid, _entries, _root_url
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.commit import Claim
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CommitError
from torch_checkpointing.manifest import INCOMPLETE_MARKER

pytest.importorskip("fsspec")

REPO = Path(__file__).resolve().parent.parent
_CHILD_TIMEOUT_S = 120


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _run_until_sigkilled(script: str, *args: str, env: dict[str, str] | None = None) -> None:
    """Runs the Python `script` with `args` in a child process (`env` added to its environment), which must end
    SIGKILLed: it kills itself at the point the test chose."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env={**_env(), **(env or {})},
        capture_output=True,
        timeout=_CHILD_TIMEOUT_S,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode(errors="replace")[-3000:]


def _killed_save(url: str, ckpt: str, user: dict[str, bytes] = USER, env: dict[str, str] | None = None) -> None:
    """A trainer SIGKILLed mid-save (after its uploads and the `user`'s files, before any manifest)."""
    args = {"url": url, "id": ckpt, "user": {rel: data.decode() for rel, data in user.items()}}
    _run_until_sigkilled(_KILLED_SAVE_CHILD, json.dumps(args), env=env)


def _plain_manager(url: str) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
    )


def test_a_save_that_takes_over_a_killed_saves_claim_removes_that_saves_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The killed save wrote `rank_0/model.safetensors`, `optim_0.pt`, `x_0.pt` and its record; the next save of
    the id (another job: the killed one's owner lock is free) writes only `model_0.pt`. Before, the committed
    checkpoint kept the killed save's record and its three files for good; now they go at the commit (named at
    WARNING by URL), and the user's files, which no record names, stay."""
    url, ckpt = _root_url("file", tmp_path), "step_1"
    _killed_save(url, ckpt)
    storage = FsspecStorageConfig(url=url).create_storage()
    dead_files, _ = _entries(storage, ckpt)
    assert {"optim_0.pt", "x_0.pt", "rank_0/model.safetensors"} <= dead_files, dead_files
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with _plain_manager(url) as manager:
        manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
        restored = manager.load(ckpt)
    assert set(restored) == {"model"}
    assert torch.equal(restored["model"]["w"], torch.arange(3.0))
    files, dirs = _entries(storage, ckpt)
    assert files == {"manifest.json", "model_0.pt", *USER}, files
    assert dirs == {"eval"}, dirs  # the killed save's `rank_0/` went with its file, the user's `eval/` stays
    assert not [name for name in files if name.startswith(INCOMPLETE_MARKER)], files
    assert f"{url}/{ckpt}/optim_0.pt" in caplog.text, caplog.text  # what went is named, by URL
    for rel in USER:
        assert storage.read(Path(ckpt) / rel) == USER[rel]


# ------------------------------------------------------------------------------- gc racing a save of the id

_PAUSED_GC_CHILD = r"""
import os, sys, time
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.retention import collect_garbage

url, pause_at, paused, go = sys.argv[1:5]

class PausingAtOneDelete(LocalFileSystem):
    # gc's delete of a file named `pause_at` (one of the dead save's files, or the dead claim's marker) waits
    # until the test says go: a gc slowed down (a large prefix, a slow store) while a save of the same id starts.
    def rm_file(self, path):
        if os.path.basename(path) == pause_at and not os.path.exists(go):
            open(paused, "w").close()
            while not os.path.exists(go):
                time.sleep(0.05)
        return super().rm_file(path)

storage = FsspecStorageConfig(url=url, filesystem=PausingAtOneDelete()).create_storage()
report = collect_garbage(url, storage, unowned_after_s=0)
print("removed", [leftover.path for leftover in report.removed], "failed", [l.path for l, _ in report.failed])
"""


def _paused_gc(url: str, pause_at: str, paused: Path, go: Path) -> subprocess.Popen[bytes]:
    """gc of `url` in a child process: right before it deletes a file named `pause_at`, it creates `paused` and
    waits until `go` exists."""
    return subprocess.Popen(
        [sys.executable, "-c", _PAUSED_GC_CHILD, url, pause_at, str(paused), str(go)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _commit_error(new_manager: Callable[[], CheckpointManager], ckpt: str, state: dict[str, Any]) -> CommitError | None:
    """Saves `state` as `ckpt` with the manager `new_manager` makes: None once it committed, else its CommitError."""
    try:
        with new_manager() as manager:
            manager.save(ckpt, state)
    except CommitError as exc:
        return exc
    return None


def _assert_loads_whole(url: str, ckpt: str) -> None:
    """Every item of the checkpoint loads (the self-describing route: all of them, not only configured ones)."""
    with _plain_manager(url) as manager:
        restored = manager.load(ckpt)
    assert torch.equal(restored["model"]["w"], torch.arange(6.0))
    assert restored["optim"] == {"lr": 0.1} and restored["x"] == 1, restored


def _wait_for(path: Path, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _CHILD_TIMEOUT_S
    while not path.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "gc never reached its pause"
        time.sleep(0.05)


def test_gc_of_a_dead_saves_prefix_never_deletes_the_files_of_a_save_taking_the_id_over(tmp_path: Path) -> None:
    """gc (one process) collects the prefix of a SIGKILLed save while a new save of the id (this process) takes
    the dead claim over. Before, gc had listed the dead save's recorded names, and its deletes went on after the
    new save had committed the same names: `latest` was a checkpoint whose `optim_0.pt` was gone. Now gc first
    holds the id with a claim of its own: the new save is refused while gc runs (naming gc), and once gc is
    done a save of the id commits a checkpoint that loads."""
    from tests.test_objstore_round21 import _manager, _state

    url, ckpt = _root_url("file", tmp_path), "step_2"
    _killed_save(url, ckpt, user={})  # a user's file left there would refuse the last save (not a checkpoint)
    paused, go = tmp_path / "paused", tmp_path / "go"
    gc = _paused_gc(url, "optim_0.pt", paused, go)
    try:
        _wait_for(paused, gc)
        refused = _commit_error(lambda: _manager(url), ckpt, _state())
        go.touch()
        out, err = gc.communicate(timeout=_CHILD_TIMEOUT_S)
    finally:
        go.touch()
        if gc.poll() is None:
            gc.kill()
            gc.wait()
    assert gc.returncode == 0, err.decode(errors="replace")[-3000:]
    if refused is None:  # the save said it committed: what it committed must be there, whole
        _assert_loads_whole(url, ckpt)
    assert refused is not None, out
    assert "gc" in str(refused) and f"{url}/{ckpt}" in str(refused), refused
    with _manager(url) as manager:  # gc is done: the id is free, and a save of it commits whole
        manager.save(ckpt, _state())
    _assert_loads_whole(url, ckpt)


@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_conditional_replace_or_delete_off_s3_leaves_a_marker_that_changed(store: str, tmp_path: Path) -> None:
    """Off S3 there is no ETag, and `replace_object` / `delete_object` ignored the version they were given: gc's
    delete of the claim it had judged dead removed the claim a new save had put there since (and a takeover
    replaced it), so that save's commit failed on "no longer holds the id" and left its files behind. They now
    compare the marker's bytes with the version read (a check, then the act: not atomic, see docs)."""
    storage = FsspecStorageConfig(url=_root_url(store, tmp_path)).create_storage()
    marker = Path("step_3") / INCOMPLETE_MARKER
    storage.mkdir(marker.parent)
    assert storage.create_object(marker, b'{"claim": "dead"}')
    judged = storage.read_object(marker)
    assert judged is not None
    assert storage.replace_object(marker, b'{"claim": "new save"}', judged[1])  # the new save's takeover
    assert not storage.replace_object(marker, b'{"claim": "third"}', judged[1])
    assert not storage.delete_object(marker, judged[1])
    assert storage.read(marker) == b'{"claim": "new save"}'
    current = storage.read_object(marker)
    assert current is not None and current[1] != judged[1]
    assert storage.delete_object(marker, current[1]) and not storage.exists(marker)
    assert not storage.replace_object(marker, b'{"claim": "fourth"}', current[1])  # gone: nothing is made
    assert not storage.exists(marker)


# ------------------------------------------------------------------------------- what a save's messages name


def _fails(_: str, __: object) -> None:
    raise RuntimeError("the pre-commit check failed")


def test_a_failed_saves_error_line_names_the_checkpoint_by_url(caplog: pytest.LogCaptureFixture) -> None:
    """The save's own ERROR line said "Checkpoint save of step_1 failed": the bare id, which `load` and the CLI
    of another process do not take without the manager's root. It names `memory://.../step_1` now."""
    caplog.set_level(logging.ERROR, logger="torch_checkpointing")
    url = _root_url("memory", Path())
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
    config.pre_finalize_callback = _fails
    with CheckpointManager(config) as manager, pytest.raises(RuntimeError, match="pre-commit"):
        manager.save("step_1", {"x": 1})
    assert f"Checkpoint save of {url}/step_1 failed (rank 0)" in caplog.text, caplog.text


def test_a_refused_save_names_the_checkpoint_by_url(tmp_path: Path) -> None:
    """A save refused before it writes (the id holds a user's folder) said "Refusing to save to step_2"."""
    url = _root_url("file", tmp_path)
    storage = FsspecStorageConfig(url=url).create_storage()
    storage.mkdir(Path("step_2"))
    storage.write(Path("step_2") / "NOTES.txt", b"mine")
    with _plain_manager(url) as manager, pytest.raises(CommitError) as refused:
        manager.save("step_2", {"x": 1})
    assert f"Refusing to save to {url}/step_2: it is a directory that is not a checkpoint" in str(refused.value)
    assert storage.read(Path("step_2") / "NOTES.txt") == b"mine"


def test_on_s3_a_save_that_takes_over_a_killed_saves_claim_removes_that_saves_objects(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """The same on S3, where the save's uploads carry its token (no records): before, the killed save's
    `optim_0.pt`, `x_0.pt` and `rank_0/model.safetensors` stayed under the new checkpoint, unlisted. Now the
    objects a save of ours wrote under another token go at the commit (each only if unchanged); the user's
    objects (untagged) stay."""
    config = s3_server.config()
    ckpt = "step_1"
    _killed_save(config.url, ckpt, env=s3_server.client_env())
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
        m.save(ckpt, {"model": {"w": torch.arange(3.0)}})
        assert torch.equal(m.load(ckpt)["model"]["w"], torch.arange(3.0))
    storage = config.create_storage()
    storage.fs.invalidate_cache()
    key = f"{config.url.removeprefix('s3://')}/{ckpt}"
    left = {name[len(key) + 1 :] for name in storage.fs.find(key)}
    assert left == {"manifest.json", "model_0.pt", *USER}, left
    assert f"{config.url}/{ckpt}/optim_0.pt" in caplog.text, caplog.text


# ------------------------------------------------------------------------------- a two-rank save, taken over

_RANKS_TIMEOUT_S = 240.0


class _SnapshotsThenFails:
    """A pre_finalize_callback on both ranks of a sync save: once both have written their files (a barrier),
    rank 0 copies the prefix aside as it is (marker, both ranks' records and files), then both fail."""

    def __init__(self, local_ckpt: str, aside: str) -> None:
        self.local_ckpt, self.aside = local_ckpt, aside

    def __call__(self, _: str, __: object) -> None:
        import shutil

        import torch.distributed as dist

        dist.barrier()
        if dist.get_rank() == 0:
            shutil.copytree(self.local_ckpt, self.aside)
        dist.barrier()
        raise RuntimeError("the pre-commit check failed")


def two_ranks_save_then_fail(url: str, ckpt: str, local_ckpt: str, aside: str) -> str:
    import torch.distributed as dist

    from tests.test_objstore_round21 import _manager

    rank = dist.get_rank()
    try:
        with _manager(url, _SnapshotsThenFails(local_ckpt, aside)) as manager:
            manager.save(ckpt, {"model": {"w": torch.full((8,), float(rank))}, "x": rank})
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


@pytest.mark.multirank
def test_a_save_that_takes_over_a_dead_two_rank_saves_claim_removes_every_ranks_files(tmp_path: Path) -> None:
    """The dead save had two ranks, each with its record and files (`rank_1/model.safetensors`, `x_1.pt`): rank 0
    of the new save (one rank, another plan) finds rank 1's names in rank 1's record. The dead prefix is the
    two-rank save's own, copied aside by it once both ranks had written and put back after its cleanup, with
    its claim made that of an ended process (as a kill leaves it)."""
    from simulator.launcher import launch

    url, ckpt = _root_url("file", tmp_path), "step_4"
    local_ckpt, aside = str(tmp_path / "run" / ckpt), str(tmp_path / "aside")
    reports = launch(two_ranks_save_then_fail, 2, args=(url, ckpt, local_ckpt, aside), timeout=_RANKS_TIMEOUT_S)
    assert all(reports), reports  # the save failed on both ranks, and cleaned up
    shutil.rmtree(local_ckpt, ignore_errors=True)
    shutil.copytree(aside, local_ckpt)
    storage = FsspecStorageConfig(url=url).create_storage()
    claim = Claim.parse(storage.read(Path(ckpt) / INCOMPLETE_MARKER))
    assert claim is not None
    storage.delete(Path(ckpt) / INCOMPLETE_MARKER)
    storage.write(Path(ckpt) / INCOMPLETE_MARKER, dataclasses.replace(claim, uid="", pid=_dead_pid()).to_bytes())
    dead_files, _ = _entries(storage, ckpt)
    assert {"x_1.pt", "rank_1/model.safetensors", "x_0.pt"} <= dead_files, dead_files
    with _plain_manager(url) as manager:
        manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
    files, dirs = _entries(storage, ckpt)
    assert files == {"manifest.json", "model_0.pt"}, files
    assert not dirs, dirs
