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

from torch_checkpointing import CheckpointManager, cli, commit, discovery, latest_checkpoint
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import default_storage
from torch_checkpointing.errors import CommitError
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy
from torch_checkpointing.retention import delete_checkpoint
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage


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


@pytest.mark.parametrize("when", ["after the listing", "during the listing", "after it was found"])
def test_a_save_whose_old_checkpoint_a_prune_deletes_while_the_save_looks_at_it_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """operations.md, "A save beside a deletion": a save replacing an id whose old checkpoint a `prune` deletes
    at that very moment commits all the same. Only the swap kept that promise: a deletion landing while the save
    looked at the id (its check of the target, before a byte is written) failed the save, after the listing with
    `CommitError: Refusing to save to .../ck: its manifest.json is not a torch_checkpointing manifest ([Errno 2]
    ... is not there: removed or replaced since it was found). Choose another id.` (a job re-saving `ck` beside a
    `prune --keep-last 1` loop: 1 save in 500), during it with a bare `FileNotFoundError` of the listing, and
    between finding the id and asking whether it is a directory with "it is an existing file, not a checkpoint"."""
    ckpt = tmp_path / "run" / "ck"
    _save(ckpt, 1.0)
    real_walk, real_ls = commit._walk, commit.Storage.ls
    deleted: list[bool] = []

    def delete_once() -> None:
        if not deleted:
            deleted.append(False)  # the deletion lists the id too
            deleted[0] = delete_checkpoint(ckpt)  # another process's prune, through the engine's own deletion

    def walk_then_delete(storage: Any, root: Path) -> list[str]:
        entries = real_walk(storage, root)
        if Path(root) == ckpt:
            delete_once()
        return entries

    def delete_then_list(storage: Any, path: Any) -> list[str]:
        if Path(path) == ckpt:
            delete_once()
        return real_ls(storage, path)

    def delete_then_look(storage: Any, path: Any) -> bool:
        if Path(path) == ckpt:
            delete_once()
        return real_isdir(storage, path)

    real_isdir = LocalFileSystemStorage.isdir
    if when == "after the listing":
        monkeypatch.setattr(commit, "_walk", walk_then_delete)
    elif when == "after it was found":
        monkeypatch.setattr(LocalFileSystemStorage, "isdir", delete_then_look)
    else:
        real_ls = LocalFileSystemStorage.ls
        monkeypatch.setattr(LocalFileSystemStorage, "ls", delete_then_list)
    _save(ckpt, 2.0)
    assert deleted == [True], "the deletion never ran"
    monkeypatch.undo()
    with CheckpointManager() as manager:
        state = manager.load(str(ckpt), {"model": None, "opt": None})
    assert torch.equal(state["model"]["w"], torch.full((300,), 2.0))


def test_a_save_gives_up_on_an_id_that_changes_at_every_look(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look again is bounded: an id whose listed manifest is gone at every look (processes saving and deleting
    it in a loop) is refused with a `CommitError` that says so, having written nothing, never looked at for good."""
    ckpt = tmp_path / "run" / "ck"
    _save(ckpt, 1.0)
    looks: list[int] = []

    def manifest_always_gone(storage: Any, path: Path) -> Any:
        looks.append(1)
        raise FileNotFoundError(2, "removed or replaced since it was found", str(path))

    monkeypatch.setattr(commit, "_read_manifest", manifest_always_gone)
    with pytest.raises(CommitError, match="changed 5 times while this save looked at it"):
        _save(ckpt, 2.0)
    monkeypatch.undo()
    assert len(looks) == 5
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["ck"]  # nothing written beside it
    with CheckpointManager() as manager:
        state = manager.load(str(ckpt), {"model": None, "opt": None})
    assert torch.equal(state["model"]["w"], torch.full((300,), 1.0))


def _retention_pass_beside(root: Path) -> None:
    """What a job with `keep_last=1` does between two looks of another process: it saves step_2, then its
    retention pass deletes step_1 (through the engine's own deletion)."""
    _save(root / "step_2", 2.0)
    assert delete_checkpoint(root / "step_1")


@pytest.mark.parametrize("when", ["after the listing", "after the manifests were read"])
def test_latest_checkpoint_beside_a_retention_pass_finds_the_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """`latest_checkpoint(root)` of a run whose job saves and prunes (`keep_last=1`) at that moment returned None
    (3 calls in 1200 against a job saving beside a `prune` loop), though the root held a checkpoint at every
    instant: the listing named step_1, the pass deleted it, and what was gone was skipped as "deleted
    meanwhile" without looking at the root again. A resume script then starts training over from step 0."""
    root = tmp_path / "run"
    _save(root / "step_1", 1.0)
    ran: list[bool] = []
    if when == "after the listing":
        real_awaiting = discovery._awaiting_replaces

        def listed_then_pruned(base: Path, names: list[str], storage: Any) -> list[str]:
            if not ran:
                ran.append(True)
                _retention_pass_beside(root)
            return real_awaiting(base, names, storage)

        monkeypatch.setattr(discovery, "_awaiting_replaces", listed_then_pruned)
    else:
        real_problem = discovery.problem_with

        def pruned_then_checked(path: Any, storage: Any) -> Any:
            if not ran:
                ran.append(True)
                _retention_pass_beside(root)
            return real_problem(path, storage)

        monkeypatch.setattr(discovery, "problem_with", pruned_then_checked)
    latest = latest_checkpoint(root)
    assert ran, "the retention pass never ran"
    assert latest is not None and Path(latest.path).name == "step_2", latest


def test_an_export_of_a_checkpoint_deleted_while_it_starts_says_it_is_gone_not_that_it_is_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`export` (and `verify`, `inspect`) of an id that a `prune` deleted between the command finding its
    directory and reading its manifest said `IncompleteCheckpointError: .../ck: no manifest.json: not a
    checkpoint` (1 export in 10 against a `prune --keep-last 1` loop), which tells the operator the directory is
    a killed save's. The id is gone: it says so, as it does when the deletion landed a moment earlier."""
    ckpt = tmp_path / "run" / "ck"
    _save(ckpt, 1.0)
    real_read = discovery.read_manifest
    ran: list[bool] = []

    def pruned_then_read(storage: Any, path: Path, *rest: Any) -> Any:
        if not ran and Path(path) == ckpt:
            ran.append(False)  # the deletion reads the manifest too
            ran[0] = delete_checkpoint(ckpt)
        return real_read(storage, path, *rest)

    monkeypatch.setattr(discovery, "read_manifest", pruned_then_read)
    code, doc, err = _cli("export", str(ckpt), "--item", "model", "--to", "hf", str(tmp_path / "hf"))
    assert ran == [True], "the deletion never ran"
    assert code == 2 and doc["kind"] == "FileNotFoundError", (code, doc, err)
    assert "no such directory" in doc["error"] and "not a checkpoint" not in doc["error"], doc
