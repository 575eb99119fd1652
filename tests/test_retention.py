"""Retention and garbage collection: the rules, crash-safe deletion, live writers left alone, several ranks."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torch_checkpointing import CheckpointManager
from torch_checkpointing.discovery import CheckpointInfo, list_checkpoints, list_leftovers
from torch_checkpointing.retention import (
    RetentionPolicy,
    apply_retention,
    collect_garbage,
    select_for_deletion,
)
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

REPO = Path(__file__).resolve().parents[1]


def _info(step: int | None, loss: float | None = None, t: float = 0.0) -> CheckpointInfo:
    metrics = None if loss is None else {"loss": loss}
    return CheckpointInfo(f"/r/s{step}-{t}", step, t, 1, 10, metrics, "x")


def _kept(infos: list[CheckpointInfo], policy: RetentionPolicy) -> list[int | None]:
    doomed = {c.path for c in select_for_deletion(infos, policy)}
    return [c.step for c in infos if c.path not in doomed]


def test_rules_combine_and_the_newest_is_always_kept() -> None:
    infos = [_info(s, loss=v) for s, v in [(0, 5.0), (10, 1.0), (20, 3.0), (30, 0.5), (40, 4.0), (50, 9.0)]]
    assert _kept(infos, RetentionPolicy()) == [0, 10, 20, 30, 40, 50]  # no rule: keep everything
    assert _kept(infos, RetentionPolicy(keep_last=2)) == [40, 50]
    assert _kept(infos, RetentionPolicy(keep_every_n_steps=20)) == [0, 20, 40, 50]
    assert _kept(infos, RetentionPolicy(keep_best=2, metric="loss")) == [10, 30, 50]
    assert _kept(infos, RetentionPolicy(keep_best=1, metric="loss", mode="max")) == [50]
    assert _kept(infos, RetentionPolicy(keep_last=1, keep_best=1, metric="loss", keep_every_n_steps=40)) == [
        0,
        30,
        40,
        50,
    ]


def test_best_ignores_checkpoints_without_the_metric_or_with_nan() -> None:
    infos = [_info(1), _info(2, float("nan")), _info(3, 2.0), _info(4)]
    assert _kept(infos, RetentionPolicy(keep_best=2, metric="loss")) == [3, 4]
    with_acc = [CheckpointInfo("/r/acc", 0, 0.0, 1, 10, {"acc": 0.5}, "x"), *infos]
    assert _kept(with_acc, RetentionPolicy(keep_best=1, metric="acc")) == [0, 4]
    # While no checkpoint records acc (a misspelt name, or no eval yet), the best by loss, the name they do
    # record, is kept in its place: a misspelt name deleted the best by the name meant.
    assert _kept(infos, RetentionPolicy(keep_best=1, metric="acc")) == [3, 4]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_every_n_steps": -1}, "keep_every_n_steps"),
        ({"keep_best": 2}, "metric"),
        ({"keep_best": 1, "metric": "loss", "mode": "best"}, "mode"),
        ({"keep_last": True}, "keep_last"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetentionPolicy(**kwargs)


@dataclass
class NoTrashStorageConfig(LocalFileSystemStorageConfig):
    """The local filesystem, except that moving a checkpoint to the trash is refused: every deletion fails."""

    use_direct_io: bool = False

    def create_storage(self) -> LocalFileSystemStorage:
        return _NoTrashStorage(self)


class _NoTrashStorage(LocalFileSystemStorage):
    def rename(self, src_path: Path, dst_path: Path, *args: Any, **kwargs: Any) -> None:
        if ".trash-" in str(dst_path):
            raise PermissionError(13, "Permission denied", str(src_path))
        super().rename(src_path, dst_path, *args, **kwargs)


def _config(async_save: bool, policy: RetentionPolicy | None) -> CheckpointManager.Config:
    cfg = CheckpointManager.Config.with_async_save() if async_save else CheckpointManager.Config.with_sync_save()
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    cfg.retention = policy
    return cfg


def test_sync_saves_prune_after_each_commit_and_leave_foreign_dirs(tmp_path: Path, caplog: Any) -> None:
    (tmp_path / "my_notes").mkdir()
    (tmp_path / "other.txt").write_text("x")
    caplog.set_level(logging.INFO, logger="torch_checkpointing")
    with CheckpointManager(_config(False, RetentionPolicy(keep_last=2, keep_best=1, metric="loss"))) as m:
        for step, loss in [(1, 0.1), (2, 0.9), (3, 0.8), (4, 0.7), (5, 0.6)]:
            m.save(str(tmp_path / f"step_{step}"), {"w": torch.full((8,), float(step))}, metrics={"loss": loss})
    # close() lets every scheduled pass finish; the last one saw all five checkpoints.
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_notes", "other.txt", "step_1", "step_4", "step_5"]
    deleted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Deleted checkpoint")]
    assert len(deleted) == 2 and all(r.levelno == logging.INFO for r in caplog.records if "Deleted" in r.getMessage())


def test_async_saves_in_flight_are_never_touched(tmp_path: Path) -> None:
    root = tmp_path / "run"
    seen_newest: list[bool] = []
    with CheckpointManager(_config(True, RetentionPolicy(keep_last=1))) as m:
        state = {"w": torch.zeros(1 << 16)}
        for step in range(6):
            state["w"].fill_(step)
            m.save(str(root / f"step_{step}"), {"model": state})  # the previous write may still be in flight
            found = list_checkpoints(root)
            seen_newest.append(not found or found[-1].step in (step - 1, step))
    assert all(seen_newest)
    (last,) = list_checkpoints(root)
    assert last.step == 5 and list_leftovers(root) == []
    with CheckpointManager(_config(False, None)) as reader:
        assert torch.equal(reader.load(last.path)["model"]["w"], torch.full((1 << 16,), 5.0))


def test_a_failed_deletion_is_logged_and_training_goes_on(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="torch_checkpointing")
    cfg = _config(False, RetentionPolicy(keep_last=1))
    cfg.storage_config = NoTrashStorageConfig()
    with CheckpointManager(cfg) as m:
        for step in range(3):
            m.save(str(tmp_path / f"step_{step}"), {"x": step})
    assert [c.step for c in list_checkpoints(tmp_path)] == [0, 1, 2]  # nothing lost, nothing half-deleted
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all("could not delete" in r.getMessage() for r in warnings)


def test_retention_under_a_configured_root(tmp_path: Path) -> None:
    policy = RetentionPolicy(keep_last=1, root=str(tmp_path / "a"))
    with CheckpointManager(_config(False, policy)) as m:
        for step in range(3):
            m.save(str(tmp_path / "a" / f"s{step}"), {"x": step})
            m.save(str(tmp_path / "b" / f"s{step}"), {"x": step})
    assert [c.step for c in list_checkpoints(tmp_path / "a")] == [2]
    assert [c.step for c in list_checkpoints(tmp_path / "b")] == [0, 1, 2]


def test_dry_run_deletes_nothing(tmp_path: Path) -> None:
    with CheckpointManager(_config(False, None)) as m:
        for step in range(3):
            m.save(str(tmp_path / f"s{step}"), {"x": step})
    doomed = apply_retention(tmp_path, RetentionPolicy(keep_last=1), dry_run=True)
    assert [c.step for c in doomed] == [0, 1] and len(list_checkpoints(tmp_path)) == 3


# ------------------------------------------------------------------------------------- kills: real processes


def _run_child(code: str, marker: str, env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if marker in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    raise AssertionError(f"child never printed {marker!r} (exit code {proc.returncode})")


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


PRUNE_CHILD = """
import sys, time
from pathlib import Path
from torch_checkpointing.discovery import default_storage
from torch_checkpointing.retention import RetentionPolicy, apply_retention

storage = default_storage()

def half_then_hang(path):
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    for f in files[: len(files) // 2]:
        f.unlink()
    print("HALF-DELETED", path, flush=True)
    time.sleep(120)

storage.rmdir = half_then_hang
apply_retention(sys.argv[1] if len(sys.argv) > 1 else "{root}", RetentionPolicy(keep_last=1), storage)
"""


def test_a_kill_during_pruning_never_leaves_a_half_deleted_checkpoint(tmp_path: Path) -> None:
    with CheckpointManager(_config(False, None)) as m:
        for step in range(3):
            m.save(str(tmp_path / f"step_{step}"), {"a": torch.ones(4) * step, "b": {"n": step}, "c": [step]})
    proc = _run_child(PRUNE_CHILD.replace("{root}", str(tmp_path)), "HALF-DELETED", {})
    _kill(proc)
    # step_0 was being removed: it is no longer listed, and what is listed loads intact (checksums verified).
    survivors = list_checkpoints(tmp_path)
    assert [c.step for c in survivors] == [1, 2]
    with CheckpointManager(_config(False, None)) as reader:
        for c in survivors:
            assert torch.equal(reader.load(c.path)["a"], torch.ones(4) * c.step)
    (trash,) = list_leftovers(tmp_path)
    assert trash.kind == "trash" and trash.checkpoint_name == "step_0" and trash.owner_alive is False
    report = collect_garbage(tmp_path)
    assert [lo.path for lo in report.removed] == [trash.path] and list_leftovers(tmp_path) == []
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]


WRITER_CHILD = """
import time, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

def hang(path, _logger):
    print("FILES-WRITTEN", flush=True)
    time.sleep(120)

cfg = CheckpointManager.Config.with_sync_save()
cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
cfg.pre_finalize_callback = hang
m = CheckpointManager(cfg)
m.save("{root}/step_7", {"model": torch.ones(1000)})
"""


def test_gc_spares_a_live_writer_and_collects_it_once_killed(tmp_path: Path) -> None:
    env = {"TORCH_CHECKPOINTING_LOCK_DIR": str(tmp_path / "locks")}
    os.environ.update(env)
    try:
        root = tmp_path / "run"
        root.mkdir()
        proc = _run_child(WRITER_CHILD.replace("{root}", str(root)), "FILES-WRITTEN", env)
        try:
            (tmp,) = list_leftovers(root)
            assert tmp.kind == "temporary" and tmp.owner_alive is True
            report = collect_garbage(root, unowned_after_s=0)
            assert report.removed == [] and report.kept[0][1] == "its owner is alive"
            assert Path(tmp.path).is_dir()
        finally:
            _kill(proc)
        (tmp,) = list_leftovers(root)
        assert tmp.owner_alive is False
        assert collect_garbage(root, dry_run=True).removed == [tmp] and Path(tmp.path).is_dir()
        assert collect_garbage(root).removed == [tmp]
        assert list(root.iterdir()) == []
    finally:
        os.environ.pop("TORCH_CHECKPOINTING_LOCK_DIR", None)


def test_unowned_temporaries_are_collected_only_when_old(tmp_path: Path) -> None:
    tmp = tmp_path / ".ck.tmp-feedbeef-1"
    tmp.mkdir()
    assert collect_garbage(tmp_path).removed == []  # no owner lock on this host: young, so kept
    old = time.time() - 10_000
    os.utime(tmp, (old, old))
    assert [Path(lo.path) for lo in collect_garbage(tmp_path, unowned_after_s=3600).removed] == [tmp]


def test_replaced_copy_is_kept_while_it_is_the_only_one(tmp_path: Path) -> None:
    """With nothing at its id it is moved back there (its replace was killed between its two renames); once a
    committed checkpoint holds the id, a copy moved aside from it is garbage."""
    with CheckpointManager(_config(False, None)) as m:
        m.save(str(tmp_path / "ck"), {"x": 1})
    aside = tmp_path / f".old_ck_{_dead_pid()}"
    os.rename(tmp_path / "ck", aside)
    report = collect_garbage(tmp_path)
    assert report.removed == [] and "the only copy of ck, moved back" in report.kept[0][1]
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    with CheckpointManager(_config(False, None)) as m:
        assert m.load(str(tmp_path / "ck")) == {"x": 1}
        shutil.copytree(tmp_path / "ck", aside)
        m.save(str(tmp_path / "ck"), {"x": 2})
    assert [Path(lo.path) for lo in collect_garbage(tmp_path).removed] == [aside]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


# ------------------------------------------------------------------------------------------------- several ranks


def retention_two_ranks(root: str) -> dict[str, Any]:
    """Rank function: async saves with retention on every rank; only rank 0 may delete."""
    rank = dist.get_rank()
    cfg = _config(True, RetentionPolicy(keep_last=2))
    deleted = _Recorded()
    logging.getLogger("torch_checkpointing").addHandler(deleted)
    logging.getLogger("torch_checkpointing").setLevel(logging.INFO)
    with CheckpointManager(cfg) as m:
        for step in range(4):
            m.save(
                f"{root}/step_{step}", {"model": {"w": torch.full((4,), float(rank + step))}}, metrics={"loss": step}
            )
    return {"rank": rank, "deleted": [m for m in deleted.messages if m.startswith("Deleted checkpoint")]}


class _Recorded(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.multirank
def test_two_ranks_prune_once_after_the_commit(tmp_path: Path) -> None:
    from simulator.launcher import launch

    results = launch(retention_two_ranks, 2, args=(str(tmp_path),), timeout=240)
    assert [len(r["deleted"]) for r in results] == [2, 0], results  # steps 0 and 1, by rank 0 alone
    found = list_checkpoints(tmp_path)
    assert [(c.step, c.world_size) for c in found] == [(2, 2), (3, 2)]
    assert list_leftovers(tmp_path) == []
    files = sorted(p.name for p in Path(found[-1].path).iterdir())
    assert files == ["manifest.json", "model_0.pt", "model_1.pt"]


def test_a_checkpoint_re_saved_since_the_listing_is_not_deleted(tmp_path: Path) -> None:
    with CheckpointManager(_config(False, None)) as m:
        m.save(str(tmp_path / "a"), {"x": 1}, step=1)
        m.save(str(tmp_path / "b"), {"x": 2}, step=2)
        listed = list_checkpoints(tmp_path)
        m.save(str(tmp_path / "a"), {"x": 3}, step=1)  # same id, committed again after the listing
    doomed = select_for_deletion(listed, RetentionPolicy(keep_last=1))
    assert [c.name for c in doomed] == ["a"]
    from torch_checkpointing.retention import delete_checkpoint

    assert delete_checkpoint(doomed[0].path, expected=doomed[0]) is False
    assert [c.name for c in list_checkpoints(tmp_path)] == ["a", "b"]
    assert delete_checkpoint(tmp_path / "a", expected=list_checkpoints(tmp_path)[0]) is True


def test_retention_does_not_delete_files_a_checkpoint_does_not_list(tmp_path: Path, caplog: Any) -> None:
    """What save() refuses to replace (a checkpoint holding a user's files), retention refuses to delete."""
    with CheckpointManager(_config(False, None)) as m:
        m.save(str(tmp_path / "step_1"), {"w": torch.ones(2)}, step=1)
    (tmp_path / "step_1" / "notes.txt").write_text("why this run diverged")
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with CheckpointManager(_config(False, RetentionPolicy(keep_last=1))) as m:
        m.save(str(tmp_path / "step_2"), {"w": torch.ones(2)}, step=2)
    assert (tmp_path / "step_1" / "notes.txt").read_text() == "why this run diverged"
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]
    assert any("notes.txt" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
