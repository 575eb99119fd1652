"""Which copy a killed non-exchange replace moved aside goes back under its id: one rule, for the trainer that
settles its dead writer (`Commit.adopt`) and for gc alike.

Each test failed before: the two decided differently, and each on less than a load needs.

* gc put back the first `.old_` copy of an id in name order, then removed the others as "replaced": with two
  copies of one id (a replace killed between its renames, the id saved again, and a second replace killed the
  same way) it put back the OLDER checkpoint and deleted the newer one, so a load of the id returned stale data.
* Both put back a copy whose manifest parses though its files do not all exist (the removal of a replaced copy
  killed midway removes its manifest last): the id then held a checkpoint that no load can read, and gc deleted
  the whole copy beside it as garbage.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_long_names_and_removal import SUBPROCESS_TIMEOUT_S, _manager
from torch_checkpointing.asides import owner_pid
from torch_checkpointing.commit import Commit, CommitTarget
from torch_checkpointing.discovery import OWNER_STARTED_AFTER_S
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.names import aside_name, new_nonce
from torch_checkpointing.retention import GcReport, collect_garbage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

# A sync save of `sys.argv[1]` (value `sys.argv[2]`) over the checkpoint there, without an atomic exchange, that
# SIGKILLs itself at `sys.argv[3]`: "between" its two renames, or "removing" the replaced copy after the first
# file of it is gone.
KILLED_CHILD = """
import os, signal, sys
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage import filesystem

path, value, moment = sys.argv[1], float(sys.argv[2]), sys.argv[3]
filesystem._renameat2 = lambda: None  # no RENAME_EXCHANGE here (NFS)
real_rename, real_unlink = filesystem.LocalFileSystemStorage.rename, os.unlink
def rename_then_die(self, src, dst, *args, **kwargs):
    real_rename(self, src, dst, *args, **kwargs)
    if moment == "between" and os.path.basename(dst).startswith(".old_"):
        os.kill(os.getpid(), signal.SIGKILL)
def unlink_then_die(name, *args, **kwargs):
    real_unlink(name, *args, **kwargs)
    if moment == "removing" and "/.old_" in os.fspath(name):
        os.kill(os.getpid(), signal.SIGKILL)
filesystem.LocalFileSystemStorage.rename = rename_then_die
os.unlink = unlink_then_die
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
    manager.save(path, {"model": {f"t{i}": torch.full((4,), value) for i in range(3)}}, step=1)
"""


def _save(ckpt: Path, value: float) -> None:
    with _manager() as manager:
        manager.save(str(ckpt), _state(value), step=1)


def _state(value: float) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {f"t{i}": torch.full((4,), value) for i in range(3)}}


def _killed_replace(ckpt: Path, value: float, moment: str) -> Path:
    """Replace `ckpt` in a child SIGKILLed at `moment`; the copy aside it left."""
    before = set(os.listdir(ckpt.parent))
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_CHILD, str(ckpt), str(value), moment],
        timeout=SUBPROCESS_TIMEOUT_S,
        capture_output=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    (aside,) = [n for n in set(os.listdir(ckpt.parent)) - before if n.startswith(".old_")]
    return ckpt.parent / aside


def _loaded(ckpt: Path) -> float:
    with _manager() as manager:
        return float(manager.load(str(ckpt), _state(0.0))["model"]["t0"][0])


def _half_removed_copy(ckpt: Path) -> Path:
    """`ckpt` (1.0) replaced by 2.0, the replacing process killed while it removed the replaced copy: the copy
    keeps its manifest (removed last) but not all its files."""
    _save(ckpt, 1.0)
    aside = _killed_replace(ckpt, 2.0, "removing")
    assert (aside / "manifest.json").is_file()
    return aside


def test_gc_puts_back_the_copy_committed_last_and_keeps_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "latest"
    _save(ckpt, 1.0)
    older = _killed_replace(ckpt, 2.0, "between")  # holds 1.0; nothing at the id
    _save(ckpt, 3.0)  # the id saved again, onto nothing
    newer = _killed_replace(ckpt, 4.0, "between")  # holds 3.0; nothing at the id
    report = collect_garbage(tmp_path, unowned_after_s=0)
    assert report.failed == [], report
    assert _loaded(ckpt) == 3.0  # the last checkpoint committed at the id
    assert not older.exists() and not newer.exists()


def test_a_dry_run_of_gc_tells_what_the_run_does_with_several_copies_of_an_id(tmp_path: Path) -> None:
    """Failed before: the dry run kept the copy not put back as "the only copy of latest (no committed
    checkpoint replaced it)" (the id, not moved in a dry run, still held nothing), and called the copy put back
    "the only copy" too; the real run then removed the other copy."""
    ckpt = tmp_path / "latest"
    _save(ckpt, 1.0)
    older = _killed_replace(ckpt, 2.0, "between")
    _save(ckpt, 3.0)
    newer = _killed_replace(ckpt, 4.0, "between")
    dry = _copies_in(collect_garbage(tmp_path, dry_run=True, unowned_after_s=0))
    assert dry == ([str(older)], [(str(newer), "the copy of latest committed last, to be moved back under its id")])
    done = _copies_in(collect_garbage(tmp_path, unowned_after_s=0))
    assert done == ([str(older)], [(str(newer), "the copy of latest committed last, moved back under its id")])
    assert _loaded(ckpt) == 3.0


def _copies_in(report: GcReport) -> tuple[list[str], list[tuple[str, str]]]:
    """The copies aside that `report` removed, and those it kept with why (the killed saves' temporaries left out)."""
    removed = [lo.path for lo in report.removed if lo.kind == "replaced"]
    return removed, [(lo.path, why) for lo, why in report.kept if lo.kind == "replaced"]


def test_gc_does_not_put_back_a_copy_whose_files_are_not_all_there(tmp_path: Path) -> None:
    ckpt = tmp_path / "latest"
    damaged = _half_removed_copy(ckpt)
    whole = _killed_replace(ckpt, 3.0, "between")  # holds 2.0, whole; nothing at the id
    report = collect_garbage(tmp_path, unowned_after_s=0)
    assert report.failed == [], report
    assert _loaded(ckpt) == 2.0
    assert not whole.exists() and not damaged.exists()  # put back; the half-removed copy is garbage


def test_gc_leaves_a_half_removed_copy_of_a_deleted_id_aside(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_1"
    damaged = _half_removed_copy(ckpt)
    shutil.rmtree(ckpt)  # the id deleted since (by hand, or a retention pass)
    collect_garbage(tmp_path, unowned_after_s=0)
    assert not ckpt.exists() and damaged.exists()


def test_the_trainer_of_a_dead_writer_does_not_put_back_a_copy_whose_files_are_not_all_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "step_1"
    damaged = _half_removed_copy(ckpt)
    shutil.rmtree(ckpt)  # what a writer killed between its renames leaves: nothing at the id
    pid = int(damaged.name.rsplit("_", 1)[1].split("-")[0])
    storage = LocalFileSystemStorageConfig(use_direct_io=False).create_storage()
    commit = Commit(storage, CommitTarget(str(ckpt), str(tmp_path / ".step_1.tmp-0123abcd-1")))
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert commit.adopt(None, writer_pid=pid) is False
    assert not ckpt.exists() and damaged.exists()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(damaged) in said and "gc" in said for said in warned), warned
    with pytest.raises((CheckpointError, FileNotFoundError)):
        _loaded(ckpt)


def test_the_trainer_of_a_dead_writer_never_puts_back_another_ids_copy_whose_name_was_cut(tmp_path: Path) -> None:
    """Failed before: the trainer chose among every copy whose cut name its id could have made. Two long ids that
    differ only past the cut (a long run name ending in the step) make the same cut names, so the copy of the
    other id, committed later, went back under this one: a load of it returned the other id's data."""
    prefix = "run_" + "s" * 236  # its aside names are cut within this prefix
    mine, other = tmp_path / f"{prefix}_step_1", tmp_path / f"{prefix}_step_2"
    _save(mine, 1.0)
    _save(other, 2.0)  # committed later
    others_copy = _killed_replace(other, 20.0, "between")
    my_copy = _killed_replace(mine, 10.0, "between")  # the dead writer's replace of `mine`
    storage = LocalFileSystemStorageConfig(use_direct_io=False).create_storage()
    commit = Commit(storage, CommitTarget(str(mine), str(tmp_path / ".tmp-of-the-dead-writer")))
    assert commit.adopt(None, writer_pid=owner_pid(my_copy)) is False
    assert _loaded(mine) == 1.0 and not my_copy.exists()
    assert others_copy.exists() and not other.exists()  # its id is not known from its name: left for the user


# A sync save of `sys.argv[1]` (value `sys.argv[2]`) on a host whose clock is an hour ahead (stepped back since).
CLOCK_AHEAD_CHILD = """
import sys, time
real_time = time.time
time.time = lambda: real_time() + 3600
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
    manager.save(sys.argv[1], {"model": {f"t{i}": torch.full((4,), float(sys.argv[2])) for i in range(3)}}, step=1)
"""


def test_the_trainer_of_a_dead_writer_puts_back_what_the_id_held_when_it_died_whatever_the_clocks(
    tmp_path: Path,
) -> None:
    """Failed before: the trainer chose by recorded commit time alone, so an older copy aside whose save ran while
    the clock was ahead (a step back since: NTP, a VM restored) went back under the id instead of the one its
    writer had just moved aside, and gc then removed the newer checkpoint as garbage."""
    ckpt = tmp_path / "latest"
    subprocess.run(
        [sys.executable, "-c", CLOCK_AHEAD_CHILD, str(ckpt), "1.0"], timeout=SUBPROCESS_TIMEOUT_S, check=True
    )
    older = _killed_replace(ckpt, 2.0, "between")  # holds 1.0, committed "an hour from now"
    _save(ckpt, 3.0)  # the id saved again, onto nothing, with the clock right
    mine = _killed_replace(ckpt, 4.0, "between")  # the dead writer's replace: it moved 3.0 aside
    storage = LocalFileSystemStorageConfig(use_direct_io=False).create_storage()
    commit = Commit(storage, CommitTarget(str(ckpt), str(tmp_path / ".tmp-of-the-dead-writer")))
    assert commit.adopt(None, writer_pid=owner_pid(mine)) is False
    assert _loaded(ckpt) == 3.0 and not mine.exists() and older.exists()


# ------------------------------------------------------------------------------------ an owner's pid reused since


_PID_WAIT_S = 120.0  # only to stop a hang


def _process_with_pid(pid: int) -> subprocess.Popen[bytes]:
    """A live process given `pid` (free: its owner is dead), as a pid is reused once the kernel wraps around.

    Another process may hold `pid` meanwhile (the tests beside this one rewind the pid counter too, and fork):
    tried again once it has ended. Fifty tries back to back failed a full parallel run while one held it."""
    deadline = time.monotonic() + _PID_WAIT_S
    while time.monotonic() < deadline:
        if os.path.exists(f"/proc/{pid}"):
            time.sleep(0.05)
            continue
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError as exc:
            pytest.skip(f"this process cannot choose the next pid ({exc}): needs CAP_SYS_ADMIN")
        proc = subprocess.Popen(["sleep", "600"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.fail(f"pid {pid} was never given to a new process (other processes fork meanwhile)")


def test_gc_puts_back_a_copy_whose_dead_owners_pid_a_later_process_has(tmp_path: Path) -> None:
    """Failed before: the owner counted alive as long as any process had its pid, so an id emptied by a killed
    replace stayed empty (gc: "its owner is alive") while, in a container, some other process had the pid."""
    ckpt = tmp_path / "latest"
    _save(ckpt, 1.0)
    aside = _killed_replace(ckpt, 2.0, "between")
    time.sleep(OWNER_STARTED_AFTER_S + 1)
    reuser = _process_with_pid(owner_pid(aside))
    try:
        report = collect_garbage(tmp_path, unowned_after_s=0)
    finally:
        reuser.kill()
        reuser.wait()
    assert report.failed == [] and not aside.exists(), report
    assert _loaded(ckpt) == 1.0


def test_gc_leaves_a_copy_whose_owner_started_before_it_was_moved_aside(tmp_path: Path) -> None:
    """The guard from the other side: a live process that was running when the copy was moved aside may be the
    replace that did it (another process of this host, between its two renames)."""
    ckpt = tmp_path / "latest"
    _save(ckpt, 1.0)
    owner = subprocess.Popen(["sleep", "600"])
    try:
        aside = ckpt.with_name(aside_name(ckpt.name, owner.pid, new_nonce()))
        os.rename(ckpt, aside)
        time.sleep(OWNER_STARTED_AFTER_S + 1)
        report = collect_garbage(tmp_path, unowned_after_s=0)
    finally:
        owner.kill()
        owner.wait()
    assert aside.exists() and not ckpt.exists(), report
