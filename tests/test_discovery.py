"""Discovery: committed checkpoints under a root, the latest one, leftovers, and self-describing loads."""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import torch_checkpointing
from torch_checkpointing import CheckpointManager, IncompleteCheckpointError, ItemSpec, TemplateMismatchError
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
)
from torch_checkpointing.discovery import (
    Leftover,
    OwnerLock,
    checkpoint_info,
    latest_checkpoint,
    list_checkpoints,
    list_leftovers,
    owner_alive,
)
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


@dataclass
class Hparams:
    lr: float
    name: str


def _manager(**items: ItemSpec) -> CheckpointManager:
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.items = items
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(cfg)


@pytest.fixture
def manager() -> CheckpointManager:
    m = _manager()
    yield m
    m.close()


def test_missing_or_empty_root_lists_nothing(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path / "nope") == []
    assert list_checkpoints(tmp_path) == []
    assert latest_checkpoint(tmp_path) is None


def test_checkpoints_sorted_by_step_with_facts_from_the_manifest(manager: CheckpointManager, tmp_path: Path) -> None:
    manager.save(str(tmp_path / "step_10"), {"model": torch.ones(4)}, metrics={"loss": 0.5})
    manager.save(str(tmp_path / "step_2"), {"model": torch.ones(4)})  # string order would put it last
    manager.save(str(tmp_path / "named"), {"model": torch.ones(4)}, step=7)
    found = list_checkpoints(tmp_path)
    assert [(c.name, c.step) for c in found] == [("step_2", 2), ("named", 7), ("step_10", 10)]
    newest = found[-1]
    assert newest.metrics == {"loss": 0.5} and found[0].metrics is None
    assert newest.world_size == 1 and newest.library_version == torch_checkpointing.__version__
    assert newest.items == ("model",)
    assert newest.total_bytes == (tmp_path / "step_10" / "model_0.pt").stat().st_size
    assert newest.commit_time is not None and abs(newest.commit_time - time.time()) < 120
    assert latest_checkpoint(tmp_path) == newest
    assert json.loads(json.dumps(newest.to_dict()))["step"] == 10


def test_same_step_is_ordered_by_commit_time_and_stepless_ones_come_first(
    manager: CheckpointManager, tmp_path: Path
) -> None:
    manager.save(str(tmp_path / "b"), {"x": 1}, step=3)
    manager.save(str(tmp_path / "a"), {"x": 1}, step=3)  # committed later: newer
    manager.save(str(tmp_path / "final"), {"x": 1})  # no step at all
    assert [c.name for c in list_checkpoints(tmp_path)] == ["final", "b", "a"]
    assert latest_checkpoint(tmp_path).name == "a"  # type: ignore[union-attr]


def test_incomplete_temporary_and_foreign_directories_are_skipped(manager: CheckpointManager, tmp_path: Path) -> None:
    manager.save(str(tmp_path / "step_1"), {"x": 1})
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".incomplete").write_bytes(b"")
    (tmp_path / "half" / "manifest.json").write_text((tmp_path / "step_1" / "manifest.json").read_text())
    (tmp_path / ".step_2.tmp-abc123-1").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "manifest.json").write_text('{"kind": "someone else"}')
    (tmp_path / "notes.txt").write_text("not a directory")
    (tmp_path / "logs").mkdir()
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_1"]
    assert checkpoint_info(tmp_path / "half") is None and checkpoint_info(tmp_path / "foreign") is None
    kinds = {Path(lo.path).name: lo.kind for lo in list_leftovers(tmp_path)}
    assert kinds == {"half": "incomplete", ".step_2.tmp-abc123-1": "temporary"}


def test_old_manifests_without_step_or_commit_time_still_list(manager: CheckpointManager, tmp_path: Path) -> None:
    manager.save(str(tmp_path / "run_0042"), {"x": 1})
    path = tmp_path / "run_0042" / "manifest.json"
    d = json.loads(path.read_text())
    for k in ("step", "commit_time", "metrics"):
        d.pop(k, None)
    path.write_text(json.dumps(d))
    (info,) = list_checkpoints(tmp_path)
    assert info.step == 42 and info.metrics is None
    assert info.commit_time == pytest.approx(path.stat().st_mtime)


def test_owner_lock_tells_live_from_dead_temporaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CHECKPOINTING_LOCK_DIR", str(tmp_path / "locks"))
    assert owner_alive("0123abcd") is None  # no lock file: cannot tell
    lock = OwnerLock("0123abcd")
    assert owner_alive("0123abcd") is True
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / ".ck.tmp-0123abcd-4").mkdir()
    (leftover,) = list_leftovers(tmp_path / "root")
    assert (leftover.kind, leftover.checkpoint_name, leftover.owner_alive) == ("temporary", "ck", True)
    # The lock of a dead owner stays on disk when another holder is gone: it can be taken exclusively.
    second = OwnerLock("0123abcd")
    lock.release()
    assert owner_alive("0123abcd") is True  # the second holder still has it
    second.release()
    assert owner_alive("0123abcd") is None  # the last holder removed the file


def test_manager_holds_its_owner_lock_while_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's temporary directory reads as owned by a live job while its manager is open, and not after."""
    monkeypatch.setenv("TORCH_CHECKPOINTING_LOCK_DIR", str(tmp_path / "locks"))
    root = tmp_path / "root"
    during_save: list[Leftover] = []
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    cfg.pre_finalize_callback = lambda checkpoint_id, _: during_save.extend(list_leftovers(root))
    m = CheckpointManager(cfg)
    m.save(str(root / "ck"), {"x": 1})
    (tmp,) = during_save  # the files are written, the commit has not renamed the directory yet
    assert (tmp.kind, tmp.checkpoint_name, tmp.owner_alive) == ("temporary", "ck", True)
    Path(tmp.path).mkdir()  # the same name again, as a crash would have left it
    assert [d.owner_alive for d in list_leftovers(root)] == [True]
    m.close()
    assert [d.owner_alive for d in list_leftovers(root)] == [None]  # the lock file went with the manager


# ------------------------------------------------------------------------------------------ self-describing loads


def test_load_without_into_returns_every_item_in_its_recorded_format(tmp_path: Path) -> None:
    items = {
        "hparams": ItemSpec(requires_copy=False, layout=LayoutInfo("cfg/hparams.json", JsonSerialization(Hparams))),
        "blob": ItemSpec(requires_copy=False, layout=LayoutInfo("blob.bin", RawSerialization())),
        "weights": ItemSpec(layout=LayoutInfo("weights.safetensors", SafetensorsSerialization())),
    }
    saver = _manager(**items)
    payload = {
        "hparams": Hparams(0.1, "x"),
        "blob": b"\x00\x01",
        "weights": {"a": torch.arange(3.0), "b": {"c": torch.ones(2, 2)}},
        "model": {"w": torch.full((2,), 3.0), "step": 5},
    }
    saver.save(str(tmp_path / "c"), payload)
    saver.close()
    with _manager() as reader:  # no Config.items: everything comes from the manifest
        got = reader.load(str(tmp_path / "c"))
    assert set(got) == {"hparams", "blob", "weights", "model"}
    assert got["hparams"] == {"lr": 0.1, "name": "x"}  # the recorded class is not imported: plain JSON
    assert got["blob"] == b"\x00\x01"
    assert torch.equal(got["weights"]["a"], torch.arange(3.0)) and torch.equal(got["weights"]["b.c"], torch.ones(2, 2))
    assert torch.equal(got["model"]["w"], torch.full((2,), 3.0)) and got["model"]["step"] == 5


def test_self_describing_load_never_imports_a_recorded_class(manager: CheckpointManager, tmp_path: Path) -> None:
    manager.save(str(tmp_path / "c"), {"x": 1})
    path = tmp_path / "c" / "manifest.json"
    d = json.loads(path.read_text())
    d["items"]["x"]["0"]["format"] = {"type": "JsonSerialization", "cls": "os.system"}
    path.write_text(json.dumps(d))
    (tmp_path / "c" / "x_0.pt").unlink()
    (tmp_path / "c" / "x_0.pt").write_text("1")
    d["items"]["x"]["0"]["size"] = 1
    import zlib

    d["items"]["x"]["0"]["crc32"] = zlib.crc32(b"1")
    d["items"]["x"]["0"].pop("blocks", None)  # the forged record is checked whole
    path.write_text(json.dumps(d))
    assert manager.load(str(tmp_path / "c")) == {"x": 1}


def test_self_describing_torch_items_still_use_the_safe_unpickler(manager: CheckpointManager, tmp_path: Path) -> None:
    manager.save(str(tmp_path / "c"), {"obj": Hparams(1.0, "unsafe")})
    with pytest.raises(Exception, match=r"weights_only|safe"):
        manager.load(str(tmp_path / "c"))


def test_not_a_checkpoint_is_named(manager: CheckpointManager, tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(IncompleteCheckpointError, match=r"no manifest\.json: not a checkpoint"):
        manager.load(str(tmp_path / "plain"))
    with pytest.raises(FileNotFoundError):
        manager.load(str(tmp_path / "absent"))


def test_typo_in_a_key_lists_the_checkpoint_keys(manager: CheckpointManager, tmp_path: Path) -> None:
    manager.save(str(tmp_path / "c"), {"model": torch.ones(1), "optimizer": {"lr": 1}})
    with pytest.raises(TemplateMismatchError, match=r"no item 'modle'.*it holds \['model', 'optimizer'\]"):
        manager.load(str(tmp_path / "c"), into={"modle": torch.zeros(1)})
    # Optional items may be absent without complaint.
    cfg_items = {"extra": ItemSpec(required=False)}
    with _manager(**cfg_items) as m:
        got = m.load(str(tmp_path / "c"), into={"model": torch.zeros(1), "extra": None})
    assert set(got) == {"model"}


def test_list_skips_dot_directories_even_if_committed(manager: CheckpointManager, tmp_path: Path) -> None:
    manager.save(str(tmp_path / "ck"), {"x": 1})
    os.rename(tmp_path / "ck", tmp_path / ".ck.trash-1-abcd")
    assert list_checkpoints(tmp_path) == []
    assert [lo.kind for lo in list_leftovers(tmp_path)] == ["trash"]


def test_an_owner_lock_not_taken_is_a_warning_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without its owner lock a job's live temporaries look abandoned to `gc --older-than`: the user must hear it."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TORCH_CHECKPOINTING_LOCK_DIR", str(tmp_path / "a-file" / "locks"))  # cannot be created
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        m = CheckpointManager(CheckpointManager.Config.with_sync_save())
    m.close()
    (record,) = [r for r in caplog.records if "Owner lock" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert str(tmp_path / "a-file" / "locks") in record.getMessage()
    assert "TORCH_CHECKPOINTING_LOCK_DIR" in record.getMessage()


def test_an_owner_lock_dropped_without_release_gives_its_descriptor_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_CHECKPOINTING_LOCK_DIR", str(tmp_path / "locks"))
    before = set(os.listdir("/proc/self/fd"))
    lock = OwnerLock("feedbeef")
    assert owner_alive("feedbeef") is True
    del lock
    gc.collect()
    assert set(os.listdir("/proc/self/fd")) <= before
    assert owner_alive("feedbeef") is False  # the file stays (as after a crash), nobody holds it
    released = OwnerLock("feedbeef")
    released.release()
    del released
    gc.collect()  # the finalizer was detached by release(): nothing is closed twice
    assert set(os.listdir("/proc/self/fd")) <= before
