"""A copy moved aside by a replace in another pid namespace of this host (a container sharing the directory,
same hostname and boot: a Kubernetes pod with hostNetwork, a container run with --uts=host).

Round 24 tagged the names of copies aside (and trash) with their host: hostname and boot id. A pid names a
process only within its pid namespace, and two containers on one host share the boot id and can share the
hostname: gc here read the other container's live replacer's pid as one of this namespace, found no such
process, judged the replace dead and put its copy back under it while it was still running. The real thing:
the replacer runs under `unshare --pid` with a pid that names no process here, stopped between its two renames.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.asides import copy_to_put_back
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.names import pid_alive
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

# The replace without an atomic exchange (NFS), stopped right after it moved the old checkpoint aside.
STOPPED_REPLACER = """
import os, signal, sys
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage import filesystem

filesystem._renameat2 = lambda: None
real_rename = filesystem.LocalFileSystemStorage.rename
def rename_then_stop(self, src, dst, *args, **kwargs):
    real_rename(self, src, dst, *args, **kwargs)
    if os.path.basename(dst).startswith(".old_"):
        os.kill(os.getpid(), signal.SIGSTOP)
filesystem.LocalFileSystemStorage.rename = rename_then_stop
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
    manager.save(sys.argv[1], {"model": {"w": torch.full((4,), 2.0)}}, step=1)
"""


def _free_pid() -> int:
    """A pid no process of this namespace has (the replacer's pid in its own namespace)."""
    return next(p for p in range(20000, 30000) if not pid_alive(p) and not pid_alive(p + 1))


def _in_another_pid_namespace(code: str, arg: str, pid: int) -> subprocess.Popen[bytes]:
    """`python -c code arg` as process `pid` of a new pid namespace (this host, its hostname and boot)."""
    script = f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid; {sys.executable} -c "$0" "$1"; exit $?'
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script, code, arg],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_unshare = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or not _can_unshare(), reason="needs unshare --pid"
)


@needs_unshare
def test_gc_never_judges_a_copy_aside_of_another_pid_namespace_dead_by_its_pid(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_1"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(ckpt), {"model": {"w": torch.full((4,), 1.0)}}, step=1)
    pid = _free_pid()
    proc = _in_another_pid_namespace(STOPPED_REPLACER, str(ckpt), pid)
    try:
        deadline = time.monotonic() + 120
        while not [n for n in os.listdir(tmp_path) if n.startswith(".old_")]:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the replacer never moved the old checkpoint aside"
            time.sleep(0.05)
        (aside,) = [tmp_path / n for n in os.listdir(tmp_path) if n.startswith(".old_")]
        assert f"_{pid}-" in aside.name and not pid_alive(pid), aside  # its pid names no process here
        storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
        choice = copy_to_put_back(storage, ckpt)
        assert choice.chosen is None and "may still be running" in choice.why_not, choice
        report = collect_garbage(tmp_path, unowned_after_s=3600)
        assert not ckpt.exists() and aside.is_dir(), report  # neither put back nor removed under its replacer
        assert [lo.owner_alive for lo, _ in report.kept if lo.path == str(aside)] == [None], report
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


# A save's claim on an object-store id (its `.incomplete` marker), made by a live process of another container.
LIVE_CLAIMANT = """
import sys, time
from torch_checkpointing.commit import Claim, CommitTarget
print(Claim.of(CommitTarget("runs/step_1", "runs/.step_1.tmp-0123456789ab-1")).to_bytes().decode(), flush=True)
time.sleep(120)
"""


@needs_unshare
def test_a_live_claim_of_another_pid_namespace_is_never_taken_over_by_its_pid() -> None:
    """Before: "its process <pid> is gone" (its pid read in this namespace), so a save here took over the id
    that the other container's save was writing, and both wrote its keys."""
    from torch_checkpointing.commit import Claim, CommitTarget, stale_reason

    pid = _free_pid()
    proc = _in_another_pid_namespace(LIVE_CLAIMANT, "", pid)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        held = Claim.parse(line)
        assert held is not None and held.pid == pid and not pid_alive(pid), line
        mine = Claim.of(CommitTarget("runs/step_1", "runs/.step_1.tmp-ba9876543210-1"))
        assert stale_reason(held, mine) is None
        legacy = Claim(held.token, held.uid, mine.host.rpartition("#")[0], 999999, held.created)  # hostname only
        assert stale_reason(legacy, mine) == "its process 999999 is gone"  # an earlier version's: this host's
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
