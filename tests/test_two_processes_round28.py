"""Two processes on one run directory at once (round 28): a save replacing an id while another process reads,
verifies, collects or prunes it. Each defect with the test that failed before its fix; the re-save is a real
save of the engine's, made deterministic by running it at a chosen point of the other command."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, cli
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import default_storage
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy


def _save(path: Path, value: float) -> None:
    # two files of the same size in every commit: only their bytes tell two commits apart
    state = {"model": {"w": torch.full((300,), value)}, "opt": {"m": torch.full((70,), value)}}
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(path), state)


def _cli(*argv: str) -> tuple[int, Any, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["--json", *argv])
    return code, json.loads(stdout.getvalue()), stderr.getvalue()


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_verify_of_an_id_saved_again_right_after_it_read_the_manifest_is_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`verify` opened the checkpoint's read context twice (`ctx.__enter__()`, then `with ctx:`), checking the
    records of the first manifest it read against the files of the directory the second opening pinned. A job
    re-saving its `latest` id in between (one `verify` in 40 against a job re-saving a 23 KB checkpoint in a loop)
    made `verify` say FAILED, exit 1 ("crc32 ... in block 0 ..., manifest records ..."), of a healthy checkpoint,
    which `verify || rm -rf` deletes; and each `verify` left the first opening's directory descriptor open."""
    ckpt = tmp_path / "run" / "latest"
    _save(ckpt, 1.0)
    real = CheckpointReadContext._open
    resaved: list[int] = []

    def open_then_resave(self: CheckpointReadContext) -> None:
        real(self)
        if not resaved and Path(str(self.root)) == ckpt:
            resaved.append(1)
            _save(ckpt, 2.0)  # another process's save of the id, right after this one read its manifest

    monkeypatch.setattr(CheckpointReadContext, "_open", open_then_resave)
    before = _descriptors()
    code, doc, err = _cli("verify", str(ckpt))
    assert resaved, "the re-save never ran"
    assert code == 0, (code, doc, err)
    assert doc["ok"] is True and [f["ok"] for f in doc["files"]] == [True, True], doc
    assert _descriptors() - before == set(), "verify left descriptors open"


def test_a_read_context_refuses_to_be_opened_twice(tmp_path: Path) -> None:
    """The class of the defect above: a second `__enter__` of an open read context pinned the id again (whatever
    it held by then) and dropped the first directory's descriptor. It is a caller's mistake, said at once."""
    ckpt = tmp_path / "latest"
    _save(ckpt, 1.0)
    before = _descriptors()
    ctx = CheckpointReadContext(default_storage(), str(ckpt), ReadPolicy())
    with ctx:
        with pytest.raises(RuntimeError, match="already open"):
            ctx.__enter__()
        assert ctx.manifest is not None
    assert _descriptors() - before == set()
