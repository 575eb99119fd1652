"""Attacks on the save path with real files, processes and signals: crafted targets, killed writers, races.

Each test here failed on the engine before the fix it names. Child processes are bounded by timeouts, and
writers a test stops or kills are killed again in `finally`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CommitError, WriterProcessDied
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT = 60
RESULT_TIMEOUT = 120


def _manager(mode: str = "sync", storage: Any = None, overwrite: bool = True) -> CheckpointManager:
    save = SyncCheckpointSaverConfig if mode == "sync" else AsyncCheckpointSaverConfig
    return CheckpointManager(
        CheckpointManager.Config(
            save=save(wait_timeout_secs=RESULT_TIMEOUT, overwrite=overwrite),
            storage_config=storage or LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _payload(tag: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((8,), tag)}}


def _save(manager: CheckpointManager, path: Path, tag: float) -> None:
    future = manager.save(str(path), _payload(tag))
    if future is not None:
        future.result(timeout=RESULT_TIMEOUT)


def _value(manager: CheckpointManager, path: Path) -> float:
    return float(manager.load(str(path), into={"model": {"w": torch.zeros(8)}})["model"]["w"][0])


def _entries(root: Path) -> set[str]:
    return {str(p.relative_to(root)) + ("/" if p.is_dir() and not p.is_symlink() else "") for p in root.rglob("*")}


# ------------------------------------------------------------------------------ symbolic links in a checkpoint

_RESAVE = """
import json, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
m = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(),
                      storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
try:
    m.save({target!r}, {{"model": {{"w": torch.full((8,), 2.0)}}}})
    print(json.dumps({{"error": None}}))
except Exception as exc:
    print(json.dumps({{"error": type(exc).__name__ + ": " + str(exc)}}))
finally:
    m.close()
"""


def _resave_in_child(target: Path) -> str | None:
    """Save over `target` in a child process, bounded; return its error ("Type: message") or None."""
    child = subprocess.run(
        [sys.executable, "-c", _RESAVE.format(target=str(target))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    lines = child.stdout.splitlines()
    assert lines, f"the child printed no result: {child.stderr}"
    error: str | None = json.loads(lines[-1])["error"]
    return error


def test_a_symlink_inside_a_checkpoint_is_not_walked(tmp_path: Path) -> None:
    # Before: the target check followed it; a link to a directory that links to itself twice (2**40 paths
    # before ELOOP), or to `/usr`, kept save() walking for hours.
    target, tree = tmp_path / "ck", tmp_path / "user_tree"
    tree.mkdir()
    (tree / "keep.txt").write_text("mine")
    for name in ("a", "b"):
        (tree / name).symlink_to(tree)
    manager = _manager()
    try:
        _save(manager, target, 1.0)
        (target / "data").symlink_to(tree)
        before = _entries(tmp_path)
        error = _resave_in_child(target)
        assert error is not None and error.startswith("CommitError"), error
        assert "(data)" in error, error  # the link is named as what the checkpoint also holds
        assert _value(manager, target) == 1.0
    finally:
        manager.close()
    assert _entries(tmp_path) == before and (tree / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["id", "ancestor"])
def test_a_fifo_as_manifest_does_not_block_the_save(tmp_path: Path, where: str) -> None:
    # Before: the target check opened it to read it, and save() waited forever for a writer to the FIFO.
    holder = tmp_path / "ck"
    holder.mkdir()
    (holder / "model_0.pt").write_bytes(b"mine")
    os.mkfifo(holder / "manifest.json")
    target = holder if where == "id" else holder / "inner"
    before = _entries(tmp_path)
    error = _resave_in_child(target)
    if where == "ancestor":  # not one of our manifests, so not a checkpoint the id would be inside of
        assert error is None and (target / "manifest.json").is_file(), error
        return
    assert error is not None and error.startswith("CommitError") and "manifest.json" in error, error
    assert _entries(tmp_path) == before


# ------------------------------------------------------------------------------------- what the id sits under


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_id_under_a_regular_file_is_refused_naming_it(tmp_path: Path, mode: str) -> None:
    # Before: a bare FileExistsError ("[Errno 17] File exists: '.../notes.txt'") from creating the parents.
    (tmp_path / "notes.txt").write_text("mine")
    manager = _manager(mode)
    try:
        with pytest.raises(CommitError, match=r"notes\.txt.* is an existing file, not a directory"):
            manager.save(str(tmp_path / "notes.txt" / "run" / "step_1"), _payload(1.0))
        _save(manager, tmp_path / "ok", 2.0)  # the manager takes the next save
    finally:
        manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "ok"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_an_id_under_a_dangling_symlink_is_refused_naming_it(tmp_path: Path) -> None:
    # Before: FileExistsError from mkdir of the link's own name. A link to a real directory is still followed.
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "real").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "real")
    manager = _manager()
    try:
        with pytest.raises(CommitError, match=r"gone.* is a symbolic link to .*nowhere.*, which does not exist"):
            manager.save(str(tmp_path / "gone" / "step_1"), _payload(1.0))
        _save(manager, tmp_path / "runs" / "step_1", 2.0)
    finally:
        manager.close()
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "gone").is_symlink()
    assert (tmp_path / "real" / "step_1" / "manifest.json").exists()


# ------------------------------------------------------------------------------------------- a killed writer


@pytest.fixture
def control(tmp_path: Path) -> Iterator[Control]:
    ctl = Control(tmp_path / "control")
    yield ctl
    ctl.reset()


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _running_writer(manager: CheckpointManager) -> int:
    """The async writer's pid once it is up: at start, or after the writer a test killed is restarted."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while manager.writer_pid is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert manager.writer_pid is not None, f"no writer process within {CHILD_TIMEOUT} s"
    return manager.writer_pid


def test_a_killed_writer_leaves_no_temporary_directory(control: Control, tmp_path: Path) -> None:
    # Before: each save whose writer was SIGKILLed (the OOM killer's way) left its `.ck.tmp-*` directory, with
    # every byte written so far, until someone ran gc: a job whose writer kept dying filled the disk.
    runs = tmp_path / "runs"
    manager = _manager("async", RecordingStorageConfig(control_dir=str(control.root)))
    writer = None
    try:
        _save(manager, runs / "ck", 1.0)
        control.block("model_0.pt")
        future = manager.save(str(runs / "ck"), _payload(2.0))
        writer = control.wait_blocked(CHILD_TIMEOUT)
        assert writer == manager.writer_pid
        os.kill(writer, signal.SIGKILL)
        # The exit code is the kill's (it read "exit code None" before the writer was reaped). Killed before it
        # began to publish (it had not told its trainer of a manifest), the save is known not to be committed.
        with pytest.raises(WriterProcessDied, match=r"exit code -9\), before the checkpoint was in place: .* NOT com"):
            future.result(timeout=RESULT_TIMEOUT)
        control.reset()
        assert sorted(p.name for p in runs.iterdir()) == ["ck"]
        assert _value(manager, runs / "ck") == 1.0
        _save(manager, runs / "ck", 3.0)  # a new writer takes the next save
        assert _value(manager, runs / "ck") == 3.0
    finally:
        control.reset()
        _kill(writer)
        manager.close()
    assert sorted(p.name for p in runs.iterdir()) == ["ck"]


# ------------------------------------------------------------------------- a directory appearing at the id


@dataclass
class _OtherProgramConfig(LocalFileSystemStorageConfig):
    """Local storage where another program makes a directory of its own at the id (`at`) during the commit:
    while the manifest is written (`when="manifest"`), or right after the commit's last look at the id
    (`when="last check"`)."""

    at: str = ""
    when: Literal["manifest", "last check"] = "manifest"

    def create_storage(self) -> LocalFileSystemStorage:
        return _OtherProgramStorage(self)


class _OtherProgramStorage(LocalFileSystemStorage):
    config: _OtherProgramConfig
    armed = False  # the manifest is written: the next look at the id is the commit's last

    def _intrude(self) -> None:
        os.makedirs(self.config.at, exist_ok=True)
        Path(self.config.at, "theirs.txt").write_text("not yours")

    def write(self, path: Path, data: Any) -> None:
        manifest = Path(path).name == "manifest.json"
        if manifest and self.config.when == "manifest":
            self._intrude()
        super().write(path, data)
        self.armed = self.armed or (manifest and self.config.when == "last check")

    def exists(self, path: Path) -> bool:
        seen = super().exists(path)
        if self.armed and os.fspath(path) == self.config.at:
            self.armed = False  # the check saw the id as it was; now the other program gets there first
            self._intrude()
        return seen


def _save_meets_the_other_program(
    tmp_path: Path, when: Literal["manifest", "last check"], refusal: str, overwrite: bool = True
) -> None:
    """A first save of `tmp_path/ck` while another program makes its directory there: refused with a
    CommitError matching `refusal`, their directory kept whole, nothing else left beside it."""
    target = tmp_path / "ck"
    manager = _manager("sync", _OtherProgramConfig(use_direct_io=False, at=str(target), when=when), overwrite)
    try:
        with pytest.raises(CommitError, match=refusal):
            manager.save(str(target), _payload(1.0))
    finally:
        manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert sorted(os.listdir(target)) == ["theirs.txt"] and (target / "theirs.txt").read_text() == "not yours"


def test_a_directory_created_at_the_id_during_the_commit_is_not_replaced(tmp_path: Path) -> None:
    # Before: the id was checked before metadata and manifest were written and fsync'd; a directory created at
    # the id meanwhile was exchanged out and deleted (theirs.txt lost) by a save that reported success.
    _save_meets_the_other_program(tmp_path, "manifest", r"not a checkpoint.*theirs\.txt")


# ------------------------------------------------------------------------------------ an id inside a checkpoint


@pytest.mark.parametrize("inner", ["inner", "x/../inner", "deep/er/step_1"])
def test_an_id_inside_a_checkpoint_is_refused(tmp_path: Path, inner: str) -> None:
    # Before: it was saved into the checkpoint's directory, which then held files its manifest does not list:
    # the outer checkpoint could no longer be re-saved, and deleting it (retention, gc) took the inner one along.
    outer = tmp_path / "ck"
    manager = _manager()
    try:
        _save(manager, outer, 1.0)
        before = _entries(tmp_path)
        with pytest.raises(CommitError, match=r"inside the checkpoint .*ck"):
            manager.save(f"{outer}/{inner}", _payload(2.0))
        assert _entries(tmp_path) == before
        _save(manager, outer, 3.0)  # still a checkpoint holding only its own files
        assert _value(manager, outer) == 3.0
    finally:
        manager.close()


def test_an_id_under_someone_elses_manifest_is_saved(tmp_path: Path) -> None:
    # A web app's manifest.json is not a checkpoint: saving below it stays allowed.
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "manifest.json").write_text('{"name": "my app"}')
    manager = _manager()
    try:
        _save(manager, tmp_path / "site" / "ck", 1.0)
        assert _value(manager, tmp_path / "site" / "ck") == 1.0
    finally:
        manager.close()


# ----------------------------------------------------------------------- writer SIGKILLed at many instants


def _big(tag: float, numel: int = 1 << 20) -> dict[str, Any]:
    return {"model": {"w": torch.full((numel,), tag)}, "optim": {"m": torch.full((numel,), tag + 0.5)}}


def _whole(manager: CheckpointManager, path: Path, numel: int = 1 << 20) -> float:
    """The tag of the checkpoint at `path`, asserting that every value in it carries that same tag."""
    out = manager.load(str(path), into={"model": {"w": torch.zeros(numel)}, "optim": {"m": torch.zeros(numel)}})
    tag = float(out["model"]["w"][0])
    assert torch.equal(out["model"]["w"], torch.full((numel,), tag)), "a mix inside model"
    assert torch.equal(out["optim"]["m"], torch.full((numel,), tag + 0.5)), "model and optim from different saves"
    return tag


def test_a_writer_killed_at_any_instant_leaves_old_or_new_and_nothing_else(tmp_path: Path) -> None:
    # Before: each kill before the commit left a `.ck.tmp-*` directory beside the id.
    runs, target = tmp_path / "runs", tmp_path / "runs" / "ck"
    manager = _manager("async")
    try:
        manager.save(str(target), _big(0.0)).result(timeout=RESULT_TIMEOUT)
        started = time.monotonic()
        manager.save(str(target), _big(1.0)).result(timeout=RESULT_TIMEOUT)
        full_s = time.monotonic() - started
        for i in range(8):
            tag = float(i + 2)
            writer = _running_writer(manager)  # the one killed last round restarts
            future = manager.save(str(target), _big(tag))
            time.sleep(full_s * i / 6)
            _kill(writer)
            try:
                future.result(timeout=RESULT_TIMEOUT)
                committed = True
            except WriterProcessDied:
                committed = False
            seen = _whole(manager, target)
            assert seen == tag if committed else seen in (tag, tag - 1), (i, seen, committed)
            assert sorted(p.name for p in runs.iterdir()) == ["ck"], i
            if seen != tag:  # the next round replaces the checkpoint the failed one left in place
                manager.save(str(target), _big(tag)).result(timeout=RESULT_TIMEOUT)
    finally:
        manager.close()


# ------------------------------------------------------------------------------------------ a long final name


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("length", [240, 255])
def test_an_id_with_a_long_name_is_saved_and_replaced(tmp_path: Path, mode: str, length: int) -> None:
    # Before: any name over 230 bytes (legal up to 255) failed with ENAMETOOLONG on the temporary name the
    # engine derives from it, a path the caller never chose.
    target = tmp_path / ("é" * (length // 2) + "s" * (length % 2))  # 2-byte characters: a cut must not split one
    assert len(target.name.encode()) == length
    manager = _manager(mode)
    try:
        _save(manager, target, 1.0)
        _save(manager, target, 2.0)
        assert _value(manager, target) == 2.0
    finally:
        manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


# -------------------------------------------------------------------------- a relative id after os.chdir()


def test_a_relative_id_after_chdir_is_saved_where_the_caller_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the writer process kept the directory it was started in, so after the script's os.chdir() an async
    # save of "ck" reported success, wrote <old cwd>/ck, and load("ck") then said the checkpoint does not exist.
    started_in, moved_to = tmp_path / "started_in", tmp_path / "moved_to"
    started_in.mkdir()
    moved_to.mkdir()
    monkeypatch.chdir(started_in)
    manager = _manager("async")
    try:
        _running_writer(manager)  # up, in started_in
        os.chdir(moved_to)
        manager.save("ck", _payload(1.0)).result(timeout=RESULT_TIMEOUT)
        assert _value(manager, Path("ck")) == 1.0
    finally:
        manager.close()
    # (The writer still runs in started_in: a coverage run leaves its data file there.)
    assert sorted(os.listdir(moved_to)) == ["ck"] and "ck" not in os.listdir(started_in)


# ------------------------------------------------------------------ another save committing between check and swap


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_directory_filled_between_the_last_check_and_the_swap_is_kept(tmp_path: Path, overwrite: bool) -> None:
    # Before: the swap exchanged whatever was at the id by then and deleted it (theirs.txt lost), and with
    # overwrite=False two racing first saves of one id both succeeded, the second replacing the first
    # (37 of 150 ids, measured with two processes). A rename that refuses a non-empty target closes the gap.
    _save_meets_the_other_program(tmp_path, "last check", r"appeared at .*ck while this save committed", overwrite)
