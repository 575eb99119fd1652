"""Saves never lose data: what a save may replace, errors after the commit, manifest facts, paths, payloads.

Each test here failed on the engine before the fix it names (issue 11).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import MemoryStorage, MemoryStorageConfig, free_port
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.agreement import Contribution, agree
from torch_checkpointing.checkpoint_layout import LayoutInfo, RawSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CommitError
from torch_checkpointing.manifest import Manifest
from torch_checkpointing.storage import filesystem
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.store_channel import StoreAddress, StoreChannel


def _sync(**kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("storage_config", LocalFileSystemStorageConfig(use_direct_io=False))
    kwargs.setdefault("save", SyncCheckpointSaverConfig())
    return CheckpointManager(CheckpointManager.Config(**kwargs))


def _payload(tag: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.full((8,), tag)}}


# ------------------------------------------------------------------------------------------- manifest facts


def test_manifest_records_step_metrics_and_commit_time(tmp_path: Path) -> None:
    manager = _sync()
    try:
        before = time.time()
        manager.save(str(tmp_path / "step_0100"), _payload(), metrics={"loss": 1.5, "acc": 1})
        manager.save(str(tmp_path / "final"), _payload(), step=7)
        manager.save(str(tmp_path / "best"), _payload())
    finally:
        manager.close()
    first = json.loads((tmp_path / "step_0100" / "manifest.json").read_text())
    assert first["step"] == 100 and first["metrics"] == {"loss": 1.5, "acc": 1.0}
    assert before <= first["commit_time"] <= time.time()
    assert json.loads((tmp_path / "final" / "manifest.json").read_text())["step"] == 7
    best = Manifest.from_json((tmp_path / "best" / "manifest.json").read_text())
    assert best.step is None and best.metrics is None and best.commit_time is not None


def test_manifest_without_the_new_fields_still_reads(tmp_path: Path) -> None:
    old = {
        "kind": "torch_checkpointing.manifest",
        "manifest_version": 1,
        "library_version": "0.2.0",
        "world_size": 1,
        "metadata_file": None,
        "items": {},
    }
    manifest = Manifest.from_json(json.dumps(old))
    assert (manifest.step, manifest.metrics, manifest.commit_time) == (None, None, None)
    assert "step" not in json.loads(manifest.to_json())


@pytest.mark.parametrize("kwargs", [{"step": "7"}, {"step": True}, {"metrics": {"loss": "low"}}, {"metrics": [1.0]}])
def test_bad_step_or_metrics_are_refused(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    manager = _sync()
    try:
        with pytest.raises(TypeError):
            manager.save(str(tmp_path / "c"), _payload(), **kwargs)
    finally:
        manager.close()
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------- what a save may replace (1)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_directory_that_is_not_a_checkpoint_is_refused_and_kept(tmp_path: Path) -> None:
    # Before: save() returned normally and left only manifest.json and model_0.pt.
    run = tmp_path / "runs" / "exp1"
    (run / "step_100").mkdir(parents=True)
    (run / "train.log").write_text("epoch 1")
    (run / "step_100" / "model.pt").write_bytes(b"x")
    before = _files(run)
    manager = _sync()
    try:
        with pytest.raises(CommitError, match=r"not a checkpoint.*step_100/, train.log"):
            manager.save(str(run), _payload())
    finally:
        manager.close()
    assert _files(run) == before
    assert sorted(p.name for p in run.parent.iterdir()) == ["exp1"], "a temporary directory was left behind"


def test_a_model_folder_is_refused(tmp_path: Path) -> None:
    # Before: saving into a Hugging Face model folder removed config.json and tokenizer.json.
    folder = tmp_path / "llama"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_text("{}")
    manager = _sync()
    try:
        with pytest.raises(CommitError, match=r"config\.json, tokenizer\.json"):
            manager.save(str(folder), _payload())
    finally:
        manager.close()
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json"]


def test_the_current_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: saving to the absolute cwd wiped it.
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "train.py").write_text("print('hi')")
    monkeypatch.chdir(cwd)
    manager = _sync()
    try:
        with pytest.raises(CommitError, match=r"train\.py"):
            manager.save(os.getcwd(), _payload())
        for bad in (".", "", "..", "a/.."):
            with pytest.raises(ValueError, match="names no directory"):
                manager.save(bad, _payload())
    finally:
        manager.close()
    assert sorted(p.name for p in cwd.iterdir()) == ["train.py"]


def test_a_file_the_user_put_inside_a_checkpoint_stops_its_replacement(tmp_path: Path) -> None:
    # Before: re-saving the id removed the notes file.
    target = tmp_path / "ck"
    manager = _sync()
    try:
        manager.save(str(target), _payload(1.0))
        (target / "notes.txt").write_text("best run so far")
        with pytest.raises(CommitError, match=r"notes\.txt"):
            manager.save(str(target), _payload(2.0))
        out = manager.load(str(target), into={"model": {"w": torch.zeros(8)}})
    finally:
        manager.close()
    assert (target / "notes.txt").read_text() == "best run so far"
    assert torch.equal(out["model"]["w"], torch.full((8,), 1.0))


def test_overwrite_is_a_visible_choice(tmp_path: Path) -> None:
    target = tmp_path / "ck"
    replacing, keeping = _sync(), _sync(save=SyncCheckpointSaverConfig(overwrite=False))
    try:
        replacing.save(str(target), _payload(1.0))
        replacing.save(str(target), _payload(2.0))  # the default replaces a checkpoint of ours, atomically
        with pytest.raises(CommitError, match="overwrite is off"):
            keeping.save(str(target), _payload(3.0))
        out = keeping.load(str(target), into={"model": {"w": torch.zeros(8)}})
        (tmp_path / "empty").mkdir()
        keeping.save(str(tmp_path / "empty"), _payload(4.0))  # an empty directory holds nothing to lose
    finally:
        replacing.close()
        keeping.close()
    assert torch.equal(out["model"]["w"], torch.full((8,), 2.0))
    assert (tmp_path / "empty" / "manifest.json").exists()


# ------------------------------------------------------------------------------ nothing fails after a commit (2)


def test_an_existing_file_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # Before: the checkpoint was committed, then save() raised NotADirectoryError, leaving .old_*/.tmp-* names.
    (tmp_path / "ck").write_text("a file")
    manager = _sync()
    try:
        with pytest.raises(CommitError, match="existing file"):
            manager.save(str(tmp_path / "ck"), _payload())
    finally:
        manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"] and (tmp_path / "ck").read_text() == "a file"


def test_a_symlink_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # Before: committed, then "Cannot call rmtree on a symbolic link".
    manager = _sync()
    try:
        manager.save(str(tmp_path / "real"), _payload(1.0))
        (tmp_path / "link").symlink_to(tmp_path / "real")
        with pytest.raises(CommitError, match="symbolic link"):
            manager.save(str(tmp_path / "link"), _payload(2.0))
    finally:
        manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    assert (tmp_path / "link").is_symlink()


def test_a_cleanup_failure_after_the_commit_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: PermissionError from save() although the new checkpoint was already in place.
    target = tmp_path / "ck"
    manager = _sync()
    try:
        manager.save(str(target), _payload(1.0))

        def undeletable(path: Any, *args: Any, **kwargs: Any) -> None:
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(filesystem, "remove_tree_marks_last", undeletable)
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            manager.save(str(target), _payload(2.0))  # must not raise: the new checkpoint is committed
        monkeypatch.undo()
        out = manager.load(str(target), into={"model": {"w": torch.zeros(8)}})
    finally:
        manager.close()
    assert torch.equal(out["model"]["w"], torch.full((8,), 2.0))
    assert any("is committed" in r.getMessage() and "Permission denied" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------- payloads and paths (13, 14)


def test_a_module_or_optimizer_is_refused_at_save(tmp_path: Path) -> None:
    # Before: saved fine, failed only at resume.
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = _sync()
    try:
        with pytest.raises(TypeError, match=r"'model' is a torch.nn.Module.*model.state_dict\(\)"):
            manager.save(str(tmp_path / "a"), {"model": model})
        with pytest.raises(TypeError, match=r"'optim' is a torch.optim.Optimizer.*optimizer.state_dict\(\)"):
            manager.save(str(tmp_path / "b"), {"model": model.state_dict(), "optim": optimizer})
    finally:
        manager.close()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_tilde_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: `~/x` made a literal `./~` directory.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    manager = _sync()
    try:
        manager.save("~/ck", _payload(1.0))
        out = manager.load("~/ck", into={"model": {"w": torch.zeros(8)}})
    finally:
        manager.close()
    assert (tmp_path / "home" / "ck" / "manifest.json").exists() and not (tmp_path / "~").exists()
    assert torch.equal(out["model"]["w"], torch.full((8,), 1.0))


def test_a_url_id_is_refused_by_a_local_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: `s3://bucket/run` silently wrote to `./s3:/bucket/run`.
    monkeypatch.chdir(tmp_path)
    manager = _sync()
    try:
        with pytest.raises(ValueError, match=r"s3:// URL.*LocalFileSystemStorage"):
            manager.save("s3://bucket/run/step_1", _payload())
    finally:
        manager.close()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- commit-file mode (object stores)


class CommitFileStorage(MemoryStorage):
    """An object store: no directory rename; it takes `mem://` ids."""

    atomic_rename = False

    def rename(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("an object store cannot rename; the commit must not try")

    def handles_url(self, checkpoint_id: str) -> bool:
        return checkpoint_id.startswith("mem://")


@dataclass
class CommitFileStorageConfig(MemoryStorageConfig):
    def create_storage(self) -> CommitFileStorage:
        return CommitFileStorage(self.store)


def test_commit_file_mode_writes_in_place_the_manifest_then_removes_the_marker() -> None:
    config = CommitFileStorageConfig()
    manager = _sync(storage_config=config)
    try:
        manager.save("mem://bucket/run/step_5", {**_payload(1.0), "meta": {"a": 1}})
        out = manager.load("mem://bucket/run/step_5", into={"model": {"w": torch.zeros(8)}, "meta": None})
    finally:
        manager.close()
    assert torch.equal(out["model"]["w"], torch.full((8,), 1.0)) and out["meta"] == {"a": 1}
    writes = [(op, path) for op, path in config.store.calls if op in ("write", "delete")]
    # The marker's removal is the commit, after the manifest: a crash between them leaves both (incomplete).
    assert writes[-1][0] == "delete" and writes[-1][1].endswith("step_5/.incomplete"), writes
    assert writes[-2] == ("write", "mem:/bucket/run/step_5/manifest.json"), writes
    assert not any(".tmp-" in path for _, path in config.store.calls), "commit-file mode used a temporary name"
    assert json.loads(config.store.files["mem:/bucket/run/step_5/manifest.json"])["step"] == 5


def test_commit_file_mode_refuses_to_overwrite_a_committed_id() -> None:
    config = CommitFileStorageConfig()
    manager = _sync(storage_config=config)
    try:
        manager.save("mem://b/ck", _payload(1.0))
        before = dict(config.store.files)
        with pytest.raises(CommitError, match="cannot replace one atomically"):
            manager.save("mem://b/ck", _payload(2.0))
    finally:
        manager.close()
    assert config.store.files == before


def test_commit_file_mode_failed_save_leaves_no_checkpoint() -> None:
    config = CommitFileStorageConfig()
    items = {"raw": ItemSpec(layout=LayoutInfo("raw.bin", RawSerialization()))}
    manager = _sync(storage_config=config, items=items)
    try:
        with pytest.raises(ValueError, match="'raw'"):
            manager.save("mem://b/ck", {"raw": "not bytes", **_payload()})
        assert not any(k.startswith("mem:/b/ck") for k in config.store.files), config.store.files
        manager.save("mem://b/ck", {"raw": b"ok", **_payload()})  # the id is free again
    finally:
        manager.close()
    assert "mem:/b/ck/manifest.json" in config.store.files


# ---------------------------------------------------------------------------------------- the agreement helper


@dataclass
class _FakeTransport:
    """Every rank's contribution is known in advance: what `exchange` would bring back from real peers."""

    rank: int
    world_size: int
    others: dict[int, Contribution]

    def exchange(self, step: str, mine: Contribution) -> list[Contribution]:
        return [mine if r == self.rank else self.others[r] for r in range(self.world_size)]


def test_agree_returns_every_rank_result_or_raises_one_error_naming_the_failed_ranks() -> None:
    ok = _FakeTransport(0, 3, {1: Contribution(value=11), 2: Contribution(value=12)})
    assert agree("step", ok, lambda: 10) == [10, 11, 12]
    failed = _FakeTransport(0, 3, {1: Contribution(error="OSError: disk full"), 2: Contribution(value=12)})
    with pytest.raises(CommitError, match=r"step failed on rank\(s\) \[1\]: rank 1: OSError: disk full") as info:
        agree("step", failed, lambda: 10)
    assert info.value.failures == {1: "OSError: disk full"}

    def refuse() -> int:
        raise KeyError("mine")

    with pytest.raises(CommitError) as mine:
        agree("step", failed, refuse)
    assert sorted(mine.value.failures) == [0, 1] and isinstance(mine.value.__cause__, KeyError)


def test_an_unreachable_store_is_a_commit_error_naming_rank_0() -> None:
    # Before: a raw DistNetworkError with C++ frames.
    with pytest.raises(CommitError, match="lost contact with rank 0") as info:
        StoreChannel(StoreAddress("127.0.0.1", free_port(), "x"), timeout_s=1.0)
    assert list(info.value.failures) == [0]


def test_a_directory_with_a_foreign_manifest_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "other"
    target.mkdir()
    (target / "manifest.json").write_text('{"kind": "someone else"}')
    manager = _sync()
    try:
        with pytest.raises(CommitError, match="not a torch_checkpointing manifest"):
            manager.save(str(target), _payload())
    finally:
        manager.close()
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json"]
