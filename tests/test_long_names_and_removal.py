"""Hidden names that fit NAME_MAX, a replace killed between its two renames, and removals killed midway.

Each test failed before its fix: the `.old_` aside and the trash names of an id whose name uses all 255 bytes
failed with ENAMETOOLONG (a save over it, a prune, a gc); a non-exchange replace SIGKILLed between its renames
left the id empty, the checkpoint under `.old_...`, and nothing ever put it back; `LocalFileSystemStorage.rmdir`
(shutil.rmtree) removed files in listing order, so a kill could leave a `.tmp-` directory without its marks
(gc no longer recognised it: a leak) or a checkpoint whose marker was gone before its data.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes import fresh_fork_statuses
from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.commit import temporary_name
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.names import NAME_MAX, aside_name, trash_name
from torch_checkpointing.retention import RetentionPolicy, apply_retention, collect_garbage
from torch_checkpointing.storage import filesystem

SUBPROCESS_TIMEOUT_S = 300  # importing torch on a loaded 2-core machine takes a while; a hang never ends
LONG = "s" * (NAME_MAX - 2)  # an id's own name may use (almost) all of NAME_MAX; `_7` makes it a step


def _manager() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))


def _state(value: float) -> dict[str, Any]:
    return {"model": {f"t{i}": torch.full((4,), value + i) for i in range(3)}, "extra": {"n": value}}


def _no_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """What NFS (or an old kernel) gives: no renameat2, so replace_directory falls back to two renames."""
    monkeypatch.setattr(filesystem, "_renameat2", lambda: None)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


# ------------------------------------------------------------------------------------------ names over NAME_MAX


@pytest.mark.parametrize("char", ["s", "é"])  # one byte, two bytes: the cut keeps whole characters
def test_hidden_names_fit_name_max_and_keep_their_patterns(char: str) -> None:
    name = char * (NAME_MAX // len(char.encode()))
    hidden_names = (aside_name(name, 4_194_304, "deadbeef"), aside_name(name, 4_194_304, None))
    for hidden in (*hidden_names, trash_name(name, 4_194_304, "deadbeef")):
        raw = os.fsencode(hidden)
        assert len(raw) <= NAME_MAX and raw.decode("utf-8")
    assert aside_name(name, 12, "0a1b2c3d").startswith(".old_") and aside_name(name, 12, "0a1b2c3d").endswith(
        "_12-0a1b2c3d"
    )
    assert aside_name("step_1", 12, None) == ".old_step_1_12" and trash_name("a", 3, "ff") == ".a.trash-3-ff"


def test_saving_over_a_long_id_without_an_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_exchange(monkeypatch)
    ckpt = tmp_path / f"{LONG}_7"
    with _manager() as manager:
        manager.save(str(ckpt), _state(1.0), step=7)
        manager.save(str(ckpt), _state(2.0), step=7)
        assert torch.equal(manager.load(str(ckpt))["model"]["t0"], torch.full((4,), 2.0))
    assert sorted(os.listdir(tmp_path)) == [ckpt.name]


def test_pruning_and_collecting_long_ids(tmp_path: Path) -> None:
    with _manager() as manager:
        for step in (1, 2, 3):
            manager.save(str(tmp_path / f"{LONG[:-1]}{step}"), _state(float(step)), step=step)
    deleted = apply_retention(tmp_path, RetentionPolicy(keep_last=1))
    assert len(deleted) == 2 and [c.step for c in list_checkpoints(tmp_path)] == [3]
    kept = tmp_path / f"{LONG[:-1]}3"
    aside = tmp_path / aside_name(kept.name, _dead_pid(), "0a1b2c3d")  # a copy a finished replace failed to remove
    shutil.copytree(kept, aside)
    tmp = Path(temporary_name(str(tmp_path / f"{LONG}_9"), "feedbeef", 1))  # a dead save's (no owner lock here)
    tmp.mkdir()
    (tmp / ".incomplete").write_bytes(b"")
    report = collect_garbage(tmp_path, unowned_after_s=0)
    assert sorted(Path(lo.path).name for lo in report.removed) == sorted([aside.name, tmp.name]), report
    assert report.failed == [] and sorted(os.listdir(tmp_path)) == [kept.name]


# ------------------------------------------------------------------ a non-exchange replace killed between renames

KILLED_REPLACE_CHILD = """
import os, signal, sys
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.commit import temporary_name
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage import filesystem

filesystem._renameat2 = lambda: None  # no RENAME_EXCHANGE here (NFS)
real_rename = filesystem.LocalFileSystemStorage.rename
def rename_then_die(self, src, dst, *args, **kwargs):
    real_rename(self, src, dst, *args, **kwargs)
    if os.path.basename(dst).startswith(".old_"):  # the old checkpoint is aside, the new one not yet in
        os.kill(os.getpid(), signal.SIGKILL)
filesystem.LocalFileSystemStorage.rename = rename_then_die
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
    manager.save(sys.argv[1], {"model": {"w": torch.full((4,), 2.0)}}, step=2)
"""


def _killed_replace(ckpt: Path) -> None:
    with _manager() as manager:
        manager.save(str(ckpt), {"model": {"w": torch.full((4,), 1.0)}}, step=1)
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_REPLACE_CHILD, str(ckpt)], timeout=SUBPROCESS_TIMEOUT_S, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def test_gc_puts_back_a_checkpoint_whose_replace_was_killed_between_its_renames(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "run" / "step_1"
    _killed_replace(ckpt)
    assert not ckpt.exists()
    (aside,) = [p for p in ckpt.parent.iterdir() if p.name.startswith(".old_")]
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        report = collect_garbage(ckpt.parent, unowned_after_s=0)
    assert report.failed == [] and [lo.path for lo, _ in report.kept] == [str(aside)]
    assert "moved back" in report.kept[0][1]
    assert any(str(ckpt) in r.getMessage() and "killed" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(ckpt.parent)) == ["step_1"]  # the dead save's temporary is collected too
    with _manager() as manager:
        assert torch.equal(manager.load(str(ckpt))["model"]["w"], torch.full((4,), 1.0))


def test_a_dry_run_gc_says_it_would_put_the_copy_back_and_moves_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "step_1"
    _killed_replace(ckpt)
    report = collect_garbage(ckpt.parent, dry_run=True, unowned_after_s=0)
    assert any("to be moved back" in why for _, why in report.kept), report.kept
    assert not ckpt.exists()


def test_a_save_after_the_killed_replace_wins_and_gc_then_drops_the_copy(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "step_1"
    _killed_replace(ckpt)
    with _manager() as manager:
        manager.save(str(ckpt), {"model": {"w": torch.full((4,), 3.0)}}, step=1)
    collect_garbage(ckpt.parent, unowned_after_s=0)
    assert sorted(os.listdir(ckpt.parent)) == ["step_1"]
    with _manager() as manager:
        assert torch.equal(manager.load(str(ckpt))["model"]["w"], torch.full((4,), 3.0))


def test_a_cut_aside_with_nothing_at_its_id_is_kept_with_what_to_do(tmp_path: Path) -> None:
    """A cut name does not tell the whole id: gc keeps the only copy and says to rename it back by hand."""
    with _manager() as manager:
        manager.save(str(tmp_path / "ck"), _state(1.0))
    aside = tmp_path / aside_name(f"{LONG}_7", _dead_pid(), "0a1b2c3d")
    os.rename(tmp_path / "ck", aside)
    report = collect_garbage(tmp_path, unowned_after_s=0)
    assert report.removed == [] and aside.is_dir()
    assert "by hand" in report.kept[0][1], report.kept


def test_gc_keeps_the_only_copy_of_a_long_id_whose_cut_name_another_committed_id_makes_too(tmp_path: Path) -> None:
    """Failed before: two long ids that differ past the cut (the run's name, then the step) make the same cut
    aside names, so gc took the copy that a replace of step 1 killed between its renames left (step 1 holding
    nothing) for a replaced copy of step 2, which is committed, and removed the only copy of step 1."""
    mine, other = tmp_path / f"{LONG}_1", tmp_path / f"{LONG}_2"
    with _manager() as manager:
        manager.save(str(mine), _state(1.0), step=1)
        manager.save(str(other), _state(2.0), step=2)
    dead = _dead_pid()
    aside = tmp_path / aside_name(mine.name, dead, "0a1b2c3d")
    assert aside == tmp_path / aside_name(other.name, dead, "0a1b2c3d")  # one cut name for both ids
    os.rename(mine, aside)  # what the killed replace of `mine` left
    report = collect_garbage(tmp_path, unowned_after_s=0)
    assert aside.is_dir() and report.removed == [], report
    assert [(Path(lo.path), "by hand" in why) for lo, why in report.kept] == [(aside, True)], report.kept


# ------------------------------------------------------------------------------------ a removal killed midway


def _rmdirs_killed(works: list[tuple[Path, int]]) -> None:
    """For each (path, unlinks): a forked child removes `path` with the storage's rmdir and SIGKILLs itself after
    `unlinks` unlinks. (Forked from a new interpreter: see `fresh_fork_statuses`.)"""
    statuses = fresh_fork_statuses(
        """
        import os, signal
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
        def killed_after(path, unlinks):
            real_unlink, done = os.unlink, [0]
            def unlink_then_die(target, *args, **kwargs):
                real_unlink(target, *args, **kwargs)
                done[0] += 1
                if done[0] == unlinks:
                    os.kill(os.getpid(), signal.SIGKILL)
            os.unlink = unlink_then_die
            LocalFileSystemStorage(LocalFileSystemStorageConfig()).rmdir(path)
        """,
        [f"killed_after({str(path)!r}, {unlinks})" for path, unlinks in works],
    )
    assert statuses == [-signal.SIGKILL] * len(works), statuses


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if not p.is_dir()]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A checkpoint of eight items (one file each): enough files that a listing order is no accident."""
    with _manager() as manager:
        items = {f"item{i}": {"w": torch.full((4,), float(i))} for i in range(8)}
        manager.save(str(tmp_path / "src" / "step_1"), items, step=1)
    return tmp_path / "src" / "step_1"


@pytest.mark.parametrize("marked", [True, False])
def test_a_failed_saves_temporary_removed_midway_stays_recognised_at_every_point(
    saved: Path, tmp_path: Path, marked: bool
) -> None:
    """A failed save's temporary, of a job with no owner lock on this host: only its marks tell gc it is ours.
    With its marker (killed while writing) or without (its swap failed after `publish` removed the marker)."""
    tmp = tmp_path / "run" / f".step_1.tmp-{uuid.uuid4().hex}-1"
    shutil.copytree(saved, tmp)
    if marked:
        (tmp / ".incomplete").write_bytes(b"")
    works = [(tmp_path / f"w{unlinks}" / tmp.name, unlinks) for unlinks in range(1, len(_files(tmp)))]
    for work, _ in works:
        shutil.copytree(tmp, work)
    _rmdirs_killed(works)
    for work, unlinks in works:
        (leftover,) = list_leftovers(work.parent)
        assert leftover.recognised, (unlinks, sorted(p.name for p in _files(work)))
        assert [Path(lo.path) for lo in collect_garbage(work.parent, unowned_after_s=0).removed] == [work]


def test_a_checkpoint_removed_midway_is_refused_by_load_at_every_point(saved: Path, tmp_path: Path) -> None:
    works = [(tmp_path / f"w{unlinks}" / "step_1", unlinks) for unlinks in range(1, len(_files(saved)))]
    for work, _ in works:
        shutil.copytree(saved, work)
    _rmdirs_killed(works)
    for work, unlinks in works:
        assert (work / "manifest.json").is_file(), (unlinks, sorted(p.name for p in _files(work)))
        with _manager() as manager, pytest.raises((CheckpointError, FileNotFoundError)):
            manager.load(str(work))


def _chattr(flag: str, path: Path) -> bool:
    chattr = shutil.which("chattr")
    return chattr is not None and subprocess.run([chattr, flag, str(path)], capture_output=True).returncode == 0


@pytest.mark.parametrize("exchange", [True, False])
def test_an_undeletable_replaced_copy_is_a_warning_after_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, exchange: bool
) -> None:
    """A file of the replaced checkpoint that cannot be unlinked (immutable: even root gets EPERM) fails its
    removal after the commit: the save succeeds, a WARNING names the copy, and that copy keeps its manifest."""
    if not exchange:
        _no_exchange(monkeypatch)
    ckpt = tmp_path / "ck"
    with _manager() as manager:
        manager.save(str(ckpt), _state(1.0))
        stuck = sorted(p for p in _files(ckpt) if p.suffix == ".pt")[0]
        if not _chattr("+i", stuck):
            pytest.skip("chattr +i is not available here (needs CAP_LINUX_IMMUTABLE and a filesystem that has it)")
        try:
            with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
                manager.save(str(ckpt), _state(2.0))
            assert torch.equal(manager.load(str(ckpt))["model"]["t0"], torch.full((4,), 2.0))
            (copy,) = [p for p in tmp_path.iterdir() if p.name != "ck"]
            assert (copy / "manifest.json").is_file() and (copy / stuck.name).is_file()
            assert any("is committed" in r.getMessage() and str(copy) in r.getMessage() for r in caplog.records)
        finally:
            for p in tmp_path.glob(f"*/{stuck.name}"):
                _chattr("-i", p)
