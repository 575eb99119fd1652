"""Local saves under real disk faults: out of inodes and out of space at each phase, a file-size limit, a
directory that refuses the commit's rename, and a replaced checkpoint that cannot be removed.

docs/durability.md, "Disk full and I/O errors": a failed write fails the save with that OSError, its errno
and the path; the temporary directory is removed, earlier checkpoints stay as they were, and the same
manager takes the next save. The project's rule for errors: they name the path and the fix. Each tmpfs here
is mounted by its test (we run as root in CI) and skipped with the reason where that is not permitted.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes import run_fresh
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

RESULT_TIMEOUT = 120
FILLER = "filler"
# With nr_inodes free: 0 fails the temporary directory, 1 its marker, 2 the first item, 3 the last, 4 the manifest.
INODE_PHASES = {"temporary directory": 0, "marker": 1, "first item": 2, "last item": 3, "manifest.json": 4}
# With 4 KiB pages free (each item below takes 4): the first item, the last one, the manifest.
PAGE_PHASES = {"first item": 0, "last item": 4, "manifest.json": 8}


def _mount(where: Path, options: str) -> str | None:
    where.mkdir(parents=True, exist_ok=True)
    try:
        command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", os.fspath(where)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs with 64 inodes of its own."""
    where = tmp_path / "small"
    reason = _mount(where, "size=16m,nr_inodes=64")
    if reason is not None:
        pytest.skip(f"cannot mount a small tmpfs ({reason})")
    try:
        yield where
    finally:
        subprocess.run(["chattr", "-R", "-a", "-i", os.fspath(where)], capture_output=True, timeout=30, check=False)
        subprocess.run(["umount", "-l", os.fspath(where)], capture_output=True, timeout=30, check=False)


def _chattr(flag: str, path: str) -> None:
    subprocess.run(["chattr", flag, path], check=True, capture_output=True, timeout=30)


def _need_chattr(where: Path) -> None:
    probe = where / "chattr_probe"
    probe.mkdir()
    done = subprocess.run(["chattr", "+a", os.fspath(probe)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"chattr +a is not permitted here: {done.stderr.strip()}")
    _chattr("-a", os.fspath(probe))
    probe.rmdir()


def lock_parent(final: str, _: Any) -> None:
    """pre_finalize_callback: make the id's parent append-only, so the commit's rename (or exchange) fails."""
    _chattr("+a", os.path.dirname(final))


def _manager(mode: str, **config: Any) -> CheckpointManager:
    save = AsyncCheckpointSaverConfig() if mode == "async" else SyncCheckpointSaverConfig()
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(CheckpointManager.Config(save=save, storage_config=storage, **config))


def _result(fut: Future[Any] | None) -> None:
    if fut is not None:
        fut.result(timeout=RESULT_TIMEOUT)


def _state(value: float, n: int = 3000) -> dict[str, Any]:
    return {"model": {"w": torch.full((n,), value)}, "optim": {"w": torch.full((n,), -value)}}


def _leave_inodes(where: Path, free: int) -> None:
    i = 0
    while os.statvfs(where).f_ffree > free:
        (where / f"{FILLER}{i}").touch()
        i += 1


def _leave_pages(where: Path, free: int) -> None:
    st = os.statvfs(where)
    (where / FILLER).write_bytes(b"\0" * (st.f_bavail * st.f_frsize - free * 4096))


def _free(where: Path) -> None:
    for name in os.listdir(where):
        if name.startswith(FILLER):
            os.unlink(where / name)


def _ours(where: Path) -> list[str]:
    return sorted(n for n in os.listdir(where) if not n.startswith(FILLER))


def _assert_says_what_failed_and_the_fix(exc: OSError, ckpt: str, fix: str) -> None:
    text = str(exc)
    assert f"checkpoint {ckpt} was not committed" in text, text
    assert "earlier checkpoint under that id, if any, is intact" in text, text
    assert fix in text, text


def _assert_loads(manager: CheckpointManager, ckpt: str, value: float) -> None:
    out = manager.load(ckpt, into=_state(0.0))
    assert torch.equal(out["model"]["w"], _state(value)["model"]["w"])


_RUNNING_OUT = [("inodes", phase) for phase in INODE_PHASES] + [("space", phase) for phase in PAGE_PHASES]


@pytest.mark.parametrize(("resource", "phase"), _RUNNING_OUT, ids=[f"{r}-{p}" for r, p in _RUNNING_OUT])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_running_out_of_inodes_or_space_at_each_phase_names_the_fix_and_keeps_the_earlier_checkpoint(
    small_fs: Path, mode: str, resource: str, phase: str
) -> None:
    """Defect: the ENOSPC of a save named only a file inside the hidden temporary directory, not the checkpoint,
    nor that the earlier one survived, nor the fix (free space, gc). durability.md: the earlier checkpoint stays,
    nothing is left, the next save works. The inodes run out at each phase, the bytes at the items and the
    manifest."""
    manager = _manager(mode)
    try:
        ckpt = os.fspath(small_fs / "step_1")
        _result(manager.save(ckpt, _state(1.0)))
        if resource == "inodes":
            _leave_inodes(small_fs, INODE_PHASES[phase])
        else:
            _leave_pages(small_fs, PAGE_PHASES[phase])
        with pytest.raises(OSError) as info:
            _result(manager.save(ckpt, _state(2.0)))
        assert info.value.errno == errno.ENOSPC and os.fspath(small_fs) in (info.value.filename or "")
        _assert_says_what_failed_and_the_fix(info.value, ckpt, f"`torch-checkpointing gc {small_fs}`")
        _assert_says_what_failed_and_the_fix(info.value, ckpt, "out of space or inodes: free some there")
        assert _ours(small_fs) == ["step_1"]  # the temporary directory is gone
        _assert_loads(manager, ckpt, 1.0)
        _free(small_fs)
        _result(manager.save(ckpt, _state(3.0)))
        _assert_loads(manager, ckpt, 3.0)
    finally:
        manager.close()


_FSIZE_SAVE = """
import errno, os, resource, signal, sys, torch
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of a fatal signal
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
ckpt = sys.argv[1]
config = CheckpointManager.Config(
    save=SyncCheckpointSaverConfig(), storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
)
manager = CheckpointManager(config)
manager.save(ckpt, {"model": {"w": torch.ones(10)}})
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
try:
    manager.save(ckpt, {"model": {"w": torch.ones(1_000_000)}})
except OSError as exc:
    print("errno", exc.errno == errno.EFBIG, "path", ckpt.rsplit("/", 1)[0] in (exc.filename or ""))
    print("message", exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print("left", sorted(os.listdir(os.path.dirname(ckpt))))
print("loaded", manager.load(ckpt, into={"model": {"w": torch.zeros(10)}})["model"]["w"].sum().item())
manager.close()
"""


def test_a_file_size_limit_names_the_limit_and_keeps_the_earlier_checkpoint(tmp_path: Path) -> None:
    """Defect (no mount needed): EFBIG said "File too large" about a temporary file, not which checkpoint
    failed nor that `ulimit -f` is the limit to raise."""
    ckpt = os.fspath(tmp_path / "step_1")
    out = run_fresh(_FSIZE_SAVE, ckpt, timeout=RESULT_TIMEOUT)
    assert "errno True path True" in out, out
    assert f"checkpoint {ckpt} was not committed" in out and "`ulimit -f`" in out, out
    assert "left ['step_1']" in out and "loaded 10.0" in out, out


@pytest.mark.parametrize("replacing", [False, True], ids=["rename", "exchange"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_commit_rename_the_directory_refuses_names_the_fix_and_gc_collects_the_temporary(
    small_fs: Path, mode: str, replacing: bool, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Defect: EPERM from the commit's rename (an append-only parent) said only "Operation not permitted";
    now it names the checkpoint and what to check. The temporary it could not remove is logged with the gc
    command, and gc removes it once the directory allows it and its owner is gone."""
    _need_chattr(small_fs)
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    ckpt = os.fspath(small_fs / "step_1")
    if replacing:
        first = _manager(mode)
        try:
            _result(first.save(ckpt, _state(1.0)))
        finally:
            first.close()
    manager = _manager(mode, pre_finalize_callback=lock_parent)
    try:
        with pytest.raises(PermissionError) as info:
            _result(manager.save(ckpt, _state(2.0)))
        assert info.value.errno == errno.EPERM
        _assert_says_what_failed_and_the_fix(info.value, ckpt, "`lsattr -d`")
        _chattr("-a", os.fspath(small_fs))
        left = [n for n in _ours(small_fs) if n != "step_1"]
        assert len(left) == 1 and left[0].startswith(".step_1.tmp-"), left
        logged = caplog.text + capfd.readouterr().err  # an async save's writer process logs to its stderr
        assert f"{small_fs / left[0]}" in logged and f"torch-checkpointing gc {small_fs}" in logged, logged
        if replacing:
            _assert_loads(manager, ckpt, 1.0)
    finally:
        manager.close()
    # once its owner is gone (the manager closed), gc takes it
    assert [x.path for x in collect_garbage(small_fs, unowned_after_s=0).removed] == [os.fspath(small_fs / left[0])]
    assert _ours(small_fs) == (["step_1"] if replacing else [])


def test_an_old_checkpoint_that_cannot_be_removed_is_named_with_gc_and_gc_removes_it(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: after the exchange, a replaced checkpoint holding an immutable subdirectory was left with two
    warnings, one saying "delete it by hand" and one naming no fix at all; neither said that gc removes it.
    The commit itself stands: the id holds the new checkpoint."""
    _need_chattr(small_fs)
    items = {"model": ItemSpec(layout=LayoutInfo("sub/model.pt", TorchSerialization()))}
    ckpt = os.fspath(small_fs / "step_1")
    manager = _manager("sync", items=items)
    try:
        _result(manager.save(ckpt, _state(1.0)))
        _chattr("+i", os.path.join(ckpt, "sub"))
        caplog.set_level(logging.WARNING, logger="torch_checkpointing")
        _result(manager.save(ckpt, _state(2.0)))
        _assert_loads(manager, ckpt, 2.0)
        left = [n for n in _ours(small_fs) if n != "step_1"]
        assert len(left) == 1 and left[0].startswith(".step_1.tmp-"), left
        about = [r.getMessage() for r in caplog.records if left[0] in r.getMessage()]
        assert about and all(f"torch-checkpointing gc {small_fs}" in m for m in about), about
        _chattr("-i", os.fspath(small_fs / left[0] / "sub"))
    finally:
        manager.close()
    assert [x.path for x in collect_garbage(small_fs, unowned_after_s=0).removed] == [os.fspath(small_fs / left[0])]
    assert _ours(small_fs) == ["step_1"]
