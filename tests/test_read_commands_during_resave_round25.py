"""`verify`, `diff` and `export` of an id that a running job saves again (a `latest` id, a re-saved step) read
the new commit, or say the checkpoint was replaced; they never call the checkpoint damaged.

Before: a save that replaced the id while `verify` read it made the next file "missing" or the directory "gone":
`verify` said FAILED, exit 1 (5 runs in 60 against a job re-saving a 8 MiB checkpoint in a loop here), which
`verify || rm -rf` reads as a damaged checkpoint; `export` failed with exit 2; `diff` compared one item of the
old commit with the other items of the new one (exit 1, "differs"). While the replacer was still removing the
old copy (its files going, its directory still linked), even a load's read context said "listed in the
checkpoint's manifest but missing: the checkpoint was damaged".

The re-save is a real save of the engine's (an atomic exchange, then the removal of the old copy), made
deterministic by running it right before or after the command opens its first file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, cli
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import default_storage
from torch_checkpointing.errors import CheckpointReplacedError, CorruptCheckpointError
from torch_checkpointing.read_context import CheckedFile, CheckpointReadContext, ReadPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage


def _payload(value: float) -> dict[str, Any]:
    # two items: the re-save lands between the first file's check and the second's
    return {"a_model": {"w": torch.full((64,), value)}, "z_extra": {"b": torch.full((4,), value)}}


def _save(path: Path, value: float) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(path), _payload(value))


def _resave_at_first_check(
    monkeypatch: pytest.MonkeyPatch, path: Path, when: str = "after", resave: Callable[[], None] | None = None
) -> list[str]:
    """Re-save `path` once, right before or after a read context first opens one of its files; that file."""
    real = CheckpointReadContext.check
    seen: list[str] = []

    def check(self: CheckpointReadContext, rel_path: str, what: str) -> CheckedFile:
        first = not seen and Path(str(self.root)) == path
        if first:
            seen.append(rel_path)
        if first and when == "before":
            (resave or (lambda: _save(path, 2.0)))()
        checked = real(self, rel_path, what)
        if first and when == "after":
            (resave or (lambda: _save(path, 2.0)))()
        return checked

    monkeypatch.setattr(CheckpointReadContext, "check", check)
    return seen


def _cli(*argv: str) -> tuple[int, Any, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main(["--json", *argv])
    return code, json.loads(stdout.getvalue()), stderr.getvalue()


# "after": the first file is open (held) when the id is replaced, the second is not; "before": none is. Export
# reads one file (one item of one rank), so only "before" can race it.
@pytest.mark.parametrize(
    ("command", "when"),
    [("verify", "before"), ("verify", "after"), ("diff", "before"), ("diff", "after"), ("export", "before")],
)
def test_a_read_command_during_a_resave_reads_the_new_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, when: str
) -> None:
    ckpt, other = tmp_path / "run" / "latest", tmp_path / "other"
    _save(ckpt, 1.0)
    _save(other, 2.0)
    seen = _resave_at_first_check(monkeypatch, ckpt, when)
    argv = {
        "verify": ["verify", str(ckpt)],
        "diff": ["diff", str(ckpt), str(other)],
        "export": ["export", str(ckpt), "--item", "a_model", "--to", "hf", str(tmp_path / "hf")],
    }[command]
    code, doc, err = _cli(*argv)
    assert seen, "the re-save never ran"
    assert code == 0, (code, doc, err)
    assert "damaged" not in json.dumps(doc).lower() and "damaged" not in err.lower(), (doc, err)
    if command == "verify":
        assert doc["ok"] is True and [f["ok"] for f in doc["files"]] == [True, True], doc
    if command == "diff":  # the re-save holds 2.0 everywhere, as `other` does: never half one commit, half the other
        assert doc["identical"] is True, doc
    if command == "export":
        assert doc["tensors"] == 1, doc


def test_a_checkpoint_whose_old_copy_is_being_removed_is_said_replaced_not_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replacer is still removing the old copy: its second file is gone, its directory still linked."""
    ckpt = tmp_path / "run" / "latest"
    _save(ckpt, 1.0)
    real_rmdir = LocalFileSystemStorage.rmdir

    def remove_one_file(self: LocalFileSystemStorage, path: Any) -> None:
        os.unlink(os.path.join(os.fspath(path), "z_extra_0.pt"))  # ...and is then paused, for this read

    def resave_pausing_its_removal() -> None:
        monkeypatch.setattr(LocalFileSystemStorage, "rmdir", remove_one_file)
        try:
            _save(ckpt, 2.0)
        finally:
            monkeypatch.setattr(LocalFileSystemStorage, "rmdir", real_rmdir)

    _resave_at_first_check(monkeypatch, ckpt, "after", resave_pausing_its_removal)
    storage = default_storage()
    with CheckpointReadContext(storage, str(ckpt), ReadPolicy()) as ctx:
        assert ctx.manifest is not None
        ctx.check("a_model_0.pt", "item 'a_model'")  # the re-save runs here
        with pytest.raises(CorruptCheckpointError) as caught:  # what callers caught before still catches it
            ctx.check("z_extra_0.pt", "item 'z_extra'")
    assert isinstance(caught.value, CheckpointReplacedError), caught.value
    assert "damaged" not in str(caught.value) and "replaced or deleted" in str(caught.value), caught.value


def test_inspect_during_a_resave_describes_one_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`inspect` reads the manifest, then the checkpoint's summary, then its sharding: a re-save between the
    first two described the new commit's step and commit time over the old commit's files."""
    ckpt = tmp_path / "run" / "latest"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(ckpt), _payload(1.0), step=1)
    real = cli.checkpoint_info
    resaved: list[bool] = []

    def info_after_a_resave(path: Any, storage: Any = None) -> Any:
        if not resaved:
            resaved.append(True)
            with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
                manager.save(str(ckpt), {"a_model": {"w": torch.ones(3)}}, step=2)  # one item now
        return real(path, storage)

    monkeypatch.setattr(cli, "checkpoint_info", info_after_a_resave)
    code, doc, err = _cli("inspect", str(ckpt))
    assert resaved and code == 0, (code, doc, err)
    assert doc["step"] == 2 and sorted(doc["items"]) == ["a_model"], doc
