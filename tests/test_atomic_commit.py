"""Atomic, durable commits: temporary directory, manifest, fsync order, crashes, replacement, legacy checkpoints."""

from __future__ import annotations

import json
import os
import signal
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_checkpointing
from tests.memory_storage import Control, RecordingStorageConfig, files_under
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, RawSerialization, TorchSerialization
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage import direct_io

RESULT_TIMEOUT = 120
ITEMS = {
    "meta": ItemSpec(layout=LayoutInfo("rank_{rank}/meta.json", JsonSerialization())),
    "blob": ItemSpec(layout=LayoutInfo("blob.bin", RawSerialization()), required=False),
}


def _sync(storage: Any = None, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage, **kwargs)
    )


def _payload(tag: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((64,), tag)}, "meta": {"tag": tag}, "blob": b"b" * 5000}


def _assert_holds(manager: CheckpointManager, path: Path, tag: float) -> None:
    out = manager.load(str(path), into={"model": {"w": torch.zeros(64)}, "meta": None}, strict=True)
    assert torch.equal(out["model"]["w"], torch.full((64,), tag)) and out["meta"] == {"tag": tag}


# ------------------------------------------------------------------------------------------- manifest


def test_manifest_records_every_file(tmp_path: Path) -> None:
    manager = _sync(items=ITEMS)
    try:
        manager.save(str(tmp_path / "c"), _payload(1.0))
    finally:
        manager.close()
    root = tmp_path / "c"
    assert files_under(root) == {"model_0.pt", "rank_0/meta.json", "blob.bin", "manifest.json"}
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["world_size"] == 1
    assert manifest["library_version"] == torch_checkpointing.__version__
    assert set(manifest["items"]) == {"model", "meta", "blob"}
    formats = {"model": TorchSerialization(), "meta": JsonSerialization(), "blob": RawSerialization()}
    paths = {"model": "model_0.pt", "meta": "rank_0/meta.json", "blob": "blob.bin"}
    for key, per_rank in manifest["items"].items():
        record = per_rank["0"]
        data = (root / record["path"]).read_bytes()
        assert record["path"] == paths[key]
        assert record["size"] == len(data)
        assert record["crc32"] == zlib.crc32(data)
        assert record["format"] == formats[key].to_dict()


def test_no_temporary_directory_or_marker_is_left_behind(tmp_path: Path) -> None:
    manager = _sync(items=ITEMS)
    try:
        manager.save(str(tmp_path / "c"), _payload(1.0))
        manager.save(str(tmp_path / "c"), _payload(2.0))
        _assert_holds(manager, tmp_path / "c", 2.0)
    finally:
        manager.close()
    assert os.listdir(tmp_path) == ["c"]
    assert ".incomplete" not in os.listdir(tmp_path / "c")


# ------------------------------------------------------------------------------------- durability order


class FsyncLog:
    """Stands in for `os` inside direct_io.py and logs each file fsync into a Control's call log."""

    def __init__(self, control: Control) -> None:
        self.control = control

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def fsync(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        with open(self.control.log_path, "a") as log:
            log.write(f"{os.getpid()}\tfsync\t{path}\n")
        os.fsync(fd)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "replace"])
def test_files_and_directories_are_synced_before_the_rename_and_the_parent_after(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, existing: bool
) -> None:
    control = Control(tmp_path / "control")
    parent = tmp_path / "ckpts"
    target = parent / "step1"
    manager = _sync(RecordingStorageConfig(control_dir=str(control.root)), items=ITEMS)
    try:
        if existing:
            manager.save(str(target), _payload(0.0))
        control.reset()
        monkeypatch.setattr(direct_io, "os", FsyncLog(control))
        manager.save(str(target), _payload(1.0))
        monkeypatch.undo()
        _assert_holds(manager, target, 1.0)
    finally:
        manager.close()
    calls = control.calls()
    ops = [c[1] for c in calls]
    # The commit step: an exchange over an existing id, a plain rename onto a new one.
    replaces = [i for i, c in enumerate(calls) if c[1] == ("replace_directory" if existing else "rename")]
    assert len(replaces) == 1, ops
    at = replaces[0]
    tmp, dst = Path(calls[at][2]), Path(calls[at][3])
    assert dst == target and tmp.parent == parent and tmp != target
    before = calls[:at]
    written = [Path(c[2]) for c in before if c[1] in ("stream_write", "write")]
    assert written and all(tmp in p.parents for p in written), "a file was written outside the temporary directory"
    fsynced = {Path(c[2]) for c in before if c[1] == "fsync"}
    for rel in files_under(target):
        assert tmp / rel in fsynced, f"{rel} was not fsynced before the rename"
    synced_dirs = [Path(c[2]) for c in before if c[1] == "sync_directory"]
    assert tmp in synced_dirs and tmp / "rank_0" in synced_dirs
    assert any(c[1] == "sync_directory" and Path(c[2]) == parent for c in calls[at + 1 :]), "parent not synced after"
    marker = tmp / ".incomplete"
    assert any(c[1] == "write" and Path(c[2]) == marker for c in before)
    assert any(c[1] == "delete" and Path(c[2]) == marker for c in before)


# ----------------------------------------------------------------------------------------- crashes


@pytest.fixture
def crash(control_async: tuple[CheckpointManager, Control]) -> Iterator[tuple[CheckpointManager, Control]]:
    yield control_async


def _kill_writer_at(manager: CheckpointManager, control: Control, path: Path, what: str, tag: float) -> BaseException:
    control.block(what)
    fut = manager.save(str(path), _payload(tag))
    pid = control.wait_blocked()
    assert pid == manager.writer_pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception) as info:
        fut.result(timeout=RESULT_TIMEOUT)
    control.reset()
    return info.value


@pytest.mark.parametrize("what", [".incomplete", "model_0.pt", "meta_0.pt", "manifest.json"])
def test_killed_save_keeps_the_old_checkpoint(
    crash: tuple[CheckpointManager, Control], tmp_path: Path, what: str
) -> None:
    manager, control = crash
    target = tmp_path / "ck"
    manager.save(str(target), {**_payload(1.0), "old_only": 1}).result(timeout=RESULT_TIMEOUT)
    before = files_under(target)
    error = _kill_writer_at(manager, control, target, what, 2.0)
    assert str(target) in str(error) or "died" in str(error), error
    assert files_under(target) == before
    _assert_holds(manager, target, 1.0)
    leftovers = [p for p in tmp_path.iterdir() if p != target]
    for leftover in leftovers:
        with pytest.raises(RuntimeError, match="incomplete"):
            manager.load(str(leftover), into={"model": None})
    manager.save(str(target), _payload(3.0)).result(timeout=RESULT_TIMEOUT)
    _assert_holds(manager, target, 3.0)
    assert "old_only_0.pt" not in files_under(target)


def test_killed_first_save_leaves_no_checkpoint(crash: tuple[CheckpointManager, Control], tmp_path: Path) -> None:
    manager, control = crash
    target = tmp_path / "ck"
    _kill_writer_at(manager, control, target, "model_0.pt", 1.0)
    assert not target.exists()
    with pytest.raises(FileNotFoundError):
        manager.load(str(target), into={"model": None})
    manager.save(str(target), _payload(2.0)).result(timeout=RESULT_TIMEOUT)
    _assert_holds(manager, target, 2.0)


def test_replacement_happens_only_once_the_new_checkpoint_is_complete(
    crash: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, control = crash
    target = tmp_path / "ck"
    manager.save(str(target), {**_payload(1.0), "old_only": 1}).result(timeout=RESULT_TIMEOUT)
    # The new checkpoint's write is held while another reader loads the id (a write delayed 0.7 s could end
    # before a busy machine had started that reader).
    control.block("model")
    try:
        fut = manager.save(str(target), _payload(2.0))
        with _sync() as reader:  # another reader (this manager's own load waits for its save: test_lifecycle_attacks)
            _assert_holds(reader, target, 1.0)  # while the new one is being written
        assert not fut.done()
    finally:
        (control.root / "block_on").unlink(missing_ok=True)
    fut.result(timeout=RESULT_TIMEOUT)
    _assert_holds(manager, target, 2.0)
    assert "old_only_0.pt" not in files_under(target)
    assert os.listdir(tmp_path) == ["ck"]


def test_failed_sync_save_leaves_the_old_checkpoint(tmp_path: Path) -> None:
    manager = _sync(items=ITEMS)
    try:
        manager.save(str(tmp_path / "c"), _payload(1.0))
        with pytest.raises(ValueError, match="'blob'"):
            manager.save(str(tmp_path / "c"), {**_payload(2.0), "blob": "not bytes"})
        _assert_holds(manager, tmp_path / "c", 1.0)
    finally:
        manager.close()
    assert os.listdir(tmp_path) == ["c"]


# -------------------------------------------------------------------------------- incomplete and legacy


def test_directory_with_incomplete_marker_is_refused(sync_manager: CheckpointManager, tmp_path: Path) -> None:
    root = tmp_path / ".ck.tmp-x"
    root.mkdir()
    (root / ".incomplete").write_bytes(b"")
    torch.save({"w": torch.ones(1)}, root / "model_0.pt")
    with pytest.raises(RuntimeError, match="incomplete") as info:
        sync_manager.load(str(root), into={"model": None})
    assert str(root) in str(info.value)


def test_directory_with_marker_and_manifest_is_still_incomplete(
    sync_manager: CheckpointManager, tmp_path: Path
) -> None:
    sync_manager.save(str(tmp_path / "c"), {"model": torch.ones(1)})
    (tmp_path / "c" / ".incomplete").write_bytes(b"")
    with pytest.raises(RuntimeError, match="incomplete"):
        sync_manager.load(str(tmp_path / "c"), into={"model": None})


def test_upstream_checkpoint_without_manifest_loads(sync_manager: CheckpointManager, tmp_path: Path) -> None:
    root = tmp_path / "legacy"
    root.mkdir()
    model = {"w": torch.arange(4.0), "b": torch.ones(2)}
    torch.save(model, root / "model_0.pt")
    torch.save(12, root / "step_0.pt")
    w = torch.zeros(4)
    into = {"model": {"w": w, "b": torch.zeros(2)}, "step": 0}
    # Asking for verification where there is nothing to verify against refuses, changing nothing.
    verifying = _sync(load=CheckpointLoaderConfig(verify_checksums=True))
    try:
        with pytest.raises(torch_checkpointing.errors.IncompleteCheckpointError, match="verify_checksums=True"):
            verifying.load(str(root), into=into, strict=True)
    finally:
        verifying.close()
    assert torch.equal(w, torch.zeros(4))
    out = sync_manager.load(str(root), into=into, strict=True)  # the default: loads, with a logged warning
    assert out["model"]["w"] is w and torch.equal(w, model["w"]) and out["step"] == 12
    with pytest.raises(RuntimeError, match="no item 'optim'.*optim_0.pt"):
        sync_manager.load(str(root), into={"optim": None})


def test_file_changed_after_commit_is_detected(tmp_path: Path) -> None:
    manager = _sync()
    checking = _sync(load=CheckpointLoaderConfig(verify_checksums=True))
    try:
        manager.save(str(tmp_path / "c"), {"model": torch.arange(100.0)})
        path = tmp_path / "c" / "model_0.pt"
        data = bytearray(path.read_bytes())
        data[-30] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(RuntimeError, match="CRC32"):
            checking.load(str(tmp_path / "c"), into={"model": None})
        path.write_bytes(bytes(data[:-10]))
        with pytest.raises(RuntimeError, match="manifest records"):
            manager.load(str(tmp_path / "c"), into={"model": None})
    finally:
        manager.close()
        checking.close()
