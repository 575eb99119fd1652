"""A listing, `latest_checkpoint` and `verify` that read a manifest while a save replaces its id.

A replace that cannot exchange directories atomically moves the old copy aside, then the new one in (on an
object store: the old manifest deleted, then the new one put). A reader that found the manifest, then read it in
that gap, got "its manifest.json went between two reads", a plain `CorruptCheckpointError`: listings skipped the
checkpoint as "a damaged checkpoint" (`latest_checkpoint` went back a step, to an older commit, while the id held
a healthy newer one) and `verify` said FAILED (exit 1), which `verify || rm -rf` reads as damage. That error is
now a `CheckpointReplacedError`, and the readers read the id again.

The replace is real (renames and a real save), run at the moment the reader reads the manifest's bytes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_checkpointing.manifest as manifest_module
from torch_checkpointing import CheckpointManager, cli, latest_checkpoint
from torch_checkpointing.errors import CheckpointReplacedError
from torch_checkpointing.manifest import read_manifest
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig


def _manager() -> CheckpointManager:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(config)


def _save(path: Path, value: float) -> None:
    with _manager() as manager:
        manager.save(str(path), {"model": {"w": torch.full((4,), value)}})


@contextlib.contextmanager
def _replaced_at_first_read(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> Iterator[None]:
    """At the first read of `ckpt`'s manifest: the old copy moved aside, the read (which fails, the file being
    gone), then the new copy (a real save of step 3's value) moved in and the old one removed."""
    real = manifest_module.read_bounded
    done: list[bool] = []

    def read_bounded(storage: Any, path: Path, *args: Any, **kwargs: Any) -> bytes:
        if done or Path(path).parent != ckpt:
            return real(storage, path, *args, **kwargs)
        done.append(True)
        aside, fresh = ckpt.parent.parent / "old", ckpt.parent.parent / "new"  # beside the root
        _save(fresh, 3.0)
        os.rename(ckpt, aside)
        try:
            return real(storage, path, *args, **kwargs)
        finally:
            os.rename(fresh, ckpt)
            shutil.rmtree(aside)

    monkeypatch.setattr(manifest_module, "read_bounded", read_bounded)
    yield
    assert done, "the manifest was never read"


@contextlib.contextmanager
def _quiet(out: io.StringIO) -> Iterator[None]:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        yield


def _run(tmp_path: Path) -> Path:
    for step in (1, 2):
        _save(tmp_path / "run" / f"step_{step}", float(step))
    return tmp_path / "run" / "step_2"


def test_latest_checkpoint_reads_the_replaced_id_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _run(tmp_path)
    with _replaced_at_first_read(monkeypatch, ckpt):
        latest = latest_checkpoint(ckpt.parent)
    assert latest is not None and latest.name == "step_2"  # not step_1: nothing is damaged
    with _manager() as manager:
        assert torch.equal(manager.load(latest.path)["model"]["w"], torch.full((4,), 3.0))


def test_ls_json_lists_the_replaced_id_and_calls_nothing_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _run(tmp_path)
    out = io.StringIO()
    with _replaced_at_first_read(monkeypatch, ckpt), _quiet(out):
        assert cli.main(["--json", "ls", str(ckpt.parent)]) == 0
    doc = json.loads(out.getvalue())
    assert [c["name"] for c in doc["checkpoints"]] == ["step_1", "step_2"], doc
    assert Path(doc["latest"]).name == "step_2" and doc["damaged"] == [], doc


def test_verify_of_the_replaced_id_checks_the_new_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _run(tmp_path)
    out = io.StringIO()
    with _replaced_at_first_read(monkeypatch, ckpt), _quiet(out):
        code = cli.main(["--json", "verify", str(ckpt)])
    assert code == 0 and json.loads(out.getvalue())["ok"] is True, out.getvalue()


def test_the_gap_is_said_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _run(tmp_path)
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=False))
    with (
        _replaced_at_first_read(monkeypatch, ckpt),
        pytest.raises(CheckpointReplacedError, match="replaced or deleted"),
    ):
        read_manifest(storage, ckpt)
