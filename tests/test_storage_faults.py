"""Saves never lose data: disk full, file-size limits, lazy tensors, directory durability, small shared memory.

Disk-full cases run against a real 8 MiB tmpfs mounted by the test (we run as root in CI); where mounting is
impossible they are skipped with the reason, and the same promises are checked with RLIMIT_FSIZE in a
subprocess, which always works.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes import REPO, memory_maps, run_fresh
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization, TorchSerialization
from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager
from torch_checkpointing.storage import filesystem
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

SUBPROCESS_TIMEOUT = 180
RESULT_TIMEOUT = 120


def _mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs of `size` at `where`; the reason it could not, or None."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", os.fspath(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", os.fspath(where)], capture_output=True, timeout=30, check=False)


def _mount_ext4(where: Path, image: Path) -> str | None:
    """Mount a 16 MiB ext4 loop image at `where` (a filesystem that takes O_DIRECT, unlike tmpfs)."""
    where.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    mkfs = ["mkfs.ext4", "-q", "-F", os.fspath(image)]
    for command in (mkfs, ["mount", "-o", "loop", os.fspath(image), os.fspath(where)]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{command[0]} failed: {exc}"
        if done.returncode != 0:
            return f"{command[0]} failed: {done.stderr.strip()}"
    return None


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A filesystem of its own, 8-16 MiB: a save bigger than that fails with ENOSPC half-way.

    tmpfs refuses O_DIRECT (the buffered path); the ext4 loop image takes it (the aligned-buffer path).
    """
    where = tmp_path / "small"
    reason = _mount_tmpfs(where, "8m") if request.param == "tmpfs" else _mount_ext4(where, tmp_path / "ext4.img")
    if reason is not None:
        pytest.skip(f"cannot mount a small {request.param} ({reason}); test_file_size_limit_* cover disk-full instead")
    try:
        yield where
    finally:
        _umount(where)


def _digest(root: Path) -> dict[str, str]:
    """Every path below `root`, files with a hash of their bytes: what 'nothing else changed' compares."""
    return {
        os.fspath(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def _run(script: str, *args: str) -> str:
    return run_fresh(script, *args, timeout=SUBPROCESS_TIMEOUT)


def _result(fut: Future[Any] | None) -> None:
    if fut is not None:
        fut.result(timeout=RESULT_TIMEOUT)


# ------------------------------------------------ points 4 and 5: a failed write touches nothing else, says why

_FSIZE_STREAM = """
import errno, gc, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of a fatal signal
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
root, direct = sys.argv[1], sys.argv[2] == "direct"
storage = LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=direct))
resource.setrlimit(resource.RLIMIT_FSIZE, (6 << 20, resource.RLIM_INFINITY))
target = os.path.join(root, "ckpt.bin")
stream = storage.stream_write(target)
try:
    with stream:
        for _ in range(10):
            stream.write(b"x" * (4 << 20))
except OSError as exc:
    print("raised", exc.errno == errno.EFBIG, exc.filename == target)
except BaseException as exc:
    print("raised-other", type(exc).__name__, exc)
log_path = os.path.join(root, "user.log")
log = open(log_path, "w")
del stream
gc.collect()  # a stream collected here must not close or write to the descriptor the log now holds
log.write("hello\\n")
log.close()
with open(log_path) as f:
    print("log", repr(f.read()))
"""


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_file_size_limit_mid_write_raises_efbig_and_leaves_other_files_alone(tmp_path: Path, mode: str) -> None:
    out = _run(_FSIZE_STREAM, os.fspath(tmp_path), mode)
    assert "raised True True" in out, out
    assert "log 'hello\\n'" in out, out


_FSIZE_MANAGER = """
import errno, gc, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import torch
from torch_checkpointing import CheckpointManager

def main():
    root, mode = sys.argv[1], sys.argv[2]
    Config = CheckpointManager.Config
    manager = CheckpointManager(Config.with_sync_save() if mode == "sync" else Config.with_async_save())
    small = {"model": {"w": torch.arange(1000.0)}}
    f = manager.save(os.path.join(root, "c1"), small); f and f.result(120)
    resource.setrlimit(resource.RLIMIT_FSIZE, (6 << 20, resource.RLIM_INFINITY))  # inherited by nothing new
    try:
        f = manager.save(os.path.join(root, "c2"), {"model": {"w": torch.randn(5_000_000)}}); f and f.result(120)
        print("no error")
    except OSError as exc:
        print("raised", exc.errno, exc.filename)
    except BaseException as exc:
        print("raised-other", type(exc).__name__, exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    f = manager.save(os.path.join(root, "c3"), small); f and f.result(120)
    out = manager.load(os.path.join(root, "c3"), into={"model": {"w": torch.zeros(1000)}})
    print("next save", torch.equal(out["model"]["w"], small["model"]["w"]))
    print("entries", sorted(os.listdir(root)))
    manager.close()

if __name__ == "__main__":
    main()
"""


def test_file_size_limit_sync_save_raises_efbig_and_the_next_save_works(tmp_path: Path) -> None:
    """The sync writer runs in the limited process itself: EFBIG, not torch's 'unexpected pos'."""
    out = _run(_FSIZE_MANAGER, os.fspath(tmp_path), "sync")
    assert f"raised {errno.EFBIG} {tmp_path}" in out and "model_0.pt" in out, out
    assert "next save True" in out, out
    assert "entries ['c1', 'c3']" in out, out


def _manager(mode: str, **config: Any) -> CheckpointManager:
    base = CheckpointManager.Config.with_async_save() if mode == "async" else CheckpointManager.Config.with_sync_save()
    for name, value in config.items():
        setattr(base, name, value)
    return CheckpointManager(base)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full_save_raises_enospc_and_changes_nothing_else(small_fs: Path, mode: str) -> None:
    manager = _manager(mode)
    try:
        small = {"model": {"w": torch.arange(1000.0)}}
        _result(manager.save(os.fspath(small_fs / "c1"), small))
        (small_fs / "notes.txt").write_text("keep me")
        before = _digest(small_fs)
        with pytest.raises(OSError) as info:
            _result(manager.save(os.fspath(small_fs / "c2"), {"model": {"w": torch.randn(4_000_000)}}))
        assert info.value.errno == errno.ENOSPC, info.value
        assert info.value.filename and info.value.filename.startswith(os.fspath(small_fs)), info.value
        log = small_fs / "user.log"
        with open(log, "w") as f:  # takes the lowest free descriptor: the one a double close would hit
            f.write("hello")
        assert log.read_text() == "hello"
        log.unlink()
        assert _digest(small_fs) == before  # the earlier checkpoint, the unrelated file, no leftovers
        _result(manager.save(os.fspath(small_fs / "c3"), small))
        out = manager.load(os.fspath(small_fs / "c3"), into={"model": {"w": torch.zeros(1000)}})
        assert torch.equal(out["model"]["w"], small["model"]["w"])
    finally:
        manager.close()


# ------------------------------------------------------------------ point 9: new parent directories are durable


def test_mkdir_fsyncs_every_directory_that_gained_an_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = LocalFileSystemStorage.sync_directory

    def record(self: LocalFileSystemStorage, path: Path) -> None:
        synced.append(os.path.realpath(path))
        real(self, path)

    monkeypatch.setattr(LocalFileSystemStorage, "sync_directory", record)
    manager = _manager("sync")
    try:
        manager.save(os.fspath(tmp_path / "runs" / "exp1" / "step_1"), {"model": {"w": torch.ones(3)}})
    finally:
        manager.close()
    for gained in (tmp_path, tmp_path / "runs", tmp_path / "runs" / "exp1"):
        assert os.path.realpath(gained) in synced, f"{gained} gained an entry but was never fsync'd: {synced}"


def test_mkdir_fsyncs_through_real_directory_descriptors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fsync reaches the OS on a descriptor of each directory (not only the storage method)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(filesystem.os, "fsync", record)
    LocalFileSystemStorage(LocalFileSystemStorageConfig()).mkdir(tmp_path / "a" / "b" / "c")
    monkeypatch.undo()
    assert (tmp_path / "a" / "b" / "c").is_dir()
    assert set(synced) >= {os.fspath(tmp_path), os.fspath(tmp_path / "a"), os.fspath(tmp_path / "a" / "b")}, synced


# ------------------------------------------------------------------- point 11: lazy conjugate and negative views


def _lazy_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, dtype=torch.complex64, generator=g)
    r = torch.randn(3, 4, generator=g)
    return {"conj": z.conj(), "mH": z.mH, "neg": torch._neg_view(r), "neg_conj": torch._neg_view(z.conj())}


@pytest.mark.parametrize("fmt", [TorchSerialization(), SafetensorsSerialization()], ids=["torch", "safetensors"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lazy_conj_and_neg_views_are_written_as_their_values(tmp_path: Path, mode: str, fmt: Any) -> None:
    values = _lazy_values()
    assert all(v.is_conj() or v.is_neg() for v in values.values())
    manager = _manager(mode, items={"m": ItemSpec(layout=LayoutInfo("m.bin", fmt))})
    try:
        _result(manager.save(os.fspath(tmp_path / "c"), {"m": dict(values)}))
    finally:
        manager.close()
    if isinstance(fmt, TorchSerialization):
        raw = torch.load(tmp_path / "c" / "m.bin", weights_only=True)
    else:
        from safetensors.torch import load_file

        raw = load_file(tmp_path / "c" / "m.bin")
    for name, value in values.items():
        stored = raw[name]
        assert not (stored.is_conj() or stored.is_neg()), f"{name}: the file holds a lazy view"
        assert torch.equal(stored, value.resolve_conj().resolve_neg()), f"{name}: wrong values written"


# --------------------------------------------------------------------------- point 10: small shared memory

_SMALL_SHM_SAVE = """
import os, sys
import torch
from torch_checkpointing import CheckpointManager

def main():
    root = sys.argv[1]
    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    weights = torch.randn(6_000_000)  # 24 MB staged: three times this /dev/shm
    manager.save(os.path.join(root, "c"), {"model": {"w": weights}}).result(120)
    out = manager.load(os.path.join(root, "c"), into={"model": {"w": torch.zeros_like(weights)}})
    manager.close()
    print("saved", torch.equal(out["model"]["w"], weights))

if __name__ == "__main__":
    main()
"""


def test_async_save_bigger_than_a_small_dev_shm_works(tmp_path: Path) -> None:
    """A container's 64 MiB /dev/shm, scaled down: an 8 MiB /dev/shm in a private mount namespace."""
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(_SMALL_SHM_SAVE))
    shell = f"mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} {script} {tmp_path}"
    try:
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=REPO
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1) here; test_staging_dir_* cover a small staging filesystem")
    if done.returncode != 0 and "saved" not in done.stdout and ("mount" in done.stderr or "unshare" in done.stderr):
        pytest.skip(f"cannot make a private /dev/shm here: {done.stderr.strip()[-300:]}")
    assert "saved True" in done.stdout, f"{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr


def _async_manager_staging_in(directory: Path) -> CheckpointManager:
    config = CheckpointManager.Config.with_async_save()
    config.save.staging_config.staging_dir = os.fspath(directory)  # type: ignore[union-attr]
    return CheckpointManager(config)


def test_staging_dir_without_room_refuses_with_the_fix_and_the_manager_goes_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    staging = tmp_path / "staging"
    reason = _mount_tmpfs(staging, "8m")
    if reason is not None:
        pytest.skip(f"cannot mount a small tmpfs ({reason})")
    try:
        manager = _async_manager_staging_in(staging)
        try:
            small = {"model": {"w": torch.arange(1000.0)}}
            _result(manager.save(os.fspath(tmp_path / "c1"), small))
            before = _digest(tmp_path / "c1")
            with pytest.raises(OSError, match="staging_dir") as info:
                _result(manager.save(os.fspath(tmp_path / "c2"), {"model": {"w": torch.randn(4_000_000)}}))
            assert info.value.errno == errno.ENOSPC
            assert not (tmp_path / "c2").exists() and _digest(tmp_path / "c1") == before
            assert os.listdir(staging) == [], "the staging file outlived its slab"
            assert "Traceback" not in capfd.readouterr().err, "a stray traceback (the writer process's?)"
            _result(manager.save(os.fspath(tmp_path / "c3"), small))
            out = manager.load(os.fspath(tmp_path / "c3"), into={"model": {"w": torch.zeros(1000)}})
            assert torch.equal(out["model"]["w"], small["model"]["w"])
        finally:
            manager.close()
    finally:
        _umount(staging)


def test_staging_dir_with_room_holds_the_slab_and_saves(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    manager = _async_manager_staging_in(staging)
    try:
        weights = torch.randn(300_000)
        _result(manager.save(os.fspath(tmp_path / "c"), {"model": {"w": weights}}))
        mapped = [region.path for region in memory_maps() if "-staging-" in region.path]
        assert any(path.startswith(f"{staging}/.torch_checkpointing-staging-") for path in mapped), mapped
        weights.add_(1)
        _result(manager.save(os.fspath(tmp_path / "d"), {"model": {"w": weights}}))  # the same slab, reused
        out = manager.load(os.fspath(tmp_path / "d"), into={"model": {"w": torch.zeros_like(weights)}})
        assert torch.equal(out["model"]["w"], weights)
    finally:
        manager.close()
    assert os.listdir(staging) == []


@pytest.mark.usefixtures("dist_world1")
@pytest.mark.parametrize("fmt", [TorchSerialization(), SafetensorsSerialization()], ids=["torch", "safetensors"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lazy_views_of_dtensor_local_shards_are_written_as_their_values(tmp_path: Path, mode: str, fmt: Any) -> None:
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0])
    z = torch.randn(4, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    value = distribute_tensor(z, mesh, [Shard(0)]).conj()
    assert value.to_local().is_conj()
    manager = _manager(mode, items={"m": ItemSpec(layout=LayoutInfo("m.bin", fmt))})
    try:
        _result(manager.save(os.fspath(tmp_path / "c"), {"m": {"z": value}}))
    finally:
        manager.close()
    if isinstance(fmt, TorchSerialization):
        stored = torch.load(tmp_path / "c" / "m.bin", weights_only=False)["z"]  # our own file: may hold a DTensor
    else:
        from safetensors.torch import load_file

        stored = load_file(tmp_path / "c" / "m.bin")["z"]
    local = stored.to_local() if hasattr(stored, "to_local") else stored
    assert not local.is_conj(), "the file holds a lazy conjugate view"
    assert torch.equal(local, z.conj().resolve_conj())


# ------------------------------------------------------------------------ the rename-aside fallback of a commit


def test_fallback_replace_puts_the_old_checkpoint_back_when_the_swap_fails(tmp_path: Path) -> None:
    """Stores without an atomic exchange rename the old checkpoint aside first; if the new one then cannot
    move in, the old one goes back under its id instead of staying hidden beside it."""
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "f").write_bytes(b"old")
    with pytest.raises(FileNotFoundError):
        Storage.replace_directory(storage, tmp_path / "missing-new", tmp_path / "ck")  # the base-class fallback
    assert (tmp_path / "ck" / "f").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_staging_dir_that_does_not_exist_is_named_with_the_fix(tmp_path: Path) -> None:
    stager = DefaultStager(CheckpointStagerConfig(staging_dir=os.fspath(tmp_path / "missing")))
    with pytest.raises(OSError, match="existing, writable directory") as info:
        stager.stage({"model": {"w": torch.ones(10)}})
    assert info.value.filename == os.fspath(tmp_path / "missing")
    stager.close()
