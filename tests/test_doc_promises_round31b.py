"""Promises of docs/guide.md and docs/durability.md held to by the real engine.

durability.md: a save id's "`~` is expanded". The functions that find what was saved under that id did not
expand it: `latest_checkpoint("~/run")` of a run saved as "~/run/step_2" was None (a missing root lists
nothing), so a job resuming from the root it saves under restarted from scratch, saying nothing.

guide.md's error table: "a layout path or format that every save will refuse is also named in a WARNING when the
manager is built". A layout whose file name is over the 255-byte limit of a name (with the shortest rank, '0',
in place of `{rank}`) is refused by every save, but the manager said nothing when it was built: an async job
learnt of it at its first save, hours into training.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec, latest_checkpoint, list_checkpoints
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.discovery import checkpoint_info
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy, collect_garbage, delete_checkpoint, prune

_LONG_NAMES = {  # item key -> a layout whose name no rank can write (None: the default '<key>_<rank>.pt')
    "file": "x" * 253 + "_{rank}.pt",
    "folder": "d" * 256 + "/model_{rank}.pt",
    "k" * 252: None,
}


def _config(key: str, path: str | None) -> CheckpointManager.Config:
    layout = None if path is None else LayoutInfo(path, TorchSerialization())
    return CheckpointManager.Config(items={key: ItemSpec(requires_copy=False, layout=layout)}).with_sync_save()


@pytest.mark.parametrize(("key", "path"), list(_LONG_NAMES.items()), ids=["file", "folder", "default_layout"])
def test_a_layout_name_over_255_bytes_is_named_when_the_manager_is_built(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str, path: str | None
) -> None:
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        manager = CheckpointManager(_config(key, path))
    try:
        warned = [
            r.getMessage() for r in caplog.records if "every save() of this item will be refused" in r.getMessage()
        ]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        assert f"Config.items[{key!r}]" in warned[0] and "255-byte limit" in warned[0]
        with pytest.raises(ConfigError, match="255-byte limit"):  # the warning says what save() does
            manager.save(str(tmp_path / "c"), {key: {"t": torch.ones(2)}})
        assert not os.path.exists(tmp_path / "c")
    finally:
        manager.close()


def test_a_layout_name_of_255_bytes_is_not_warned_about_and_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = "x" * 250 + "_{rank}.pt"  # 255 bytes on ranks 0-9
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        manager = CheckpointManager(_config("item", path))
    try:
        assert not [r for r in caplog.records if "will be refused" in r.getMessage()]
        manager.save(str(tmp_path / "c"), {"item": {"t": torch.ones(2)}})
        assert (tmp_path / "c" / ("x" * 250 + "_0.pt")).is_file()
    finally:
        manager.close()


@pytest.fixture
def run_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Steps 1-3 saved as '~/run/step_N', HOME a fresh directory; the working directory holds no 'run'."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        for step in (1, 2, 3):
            manager.save(f"~/run/step_{step}", {"m": {"t": torch.ones(2)}})
    assert sorted(os.listdir(home / "run")) == ["step_1", "step_2", "step_3"]
    return home / "run"


def _steps(run: Path) -> list[str]:
    return sorted(name for name in os.listdir(run) if not name.startswith("."))


_FINDS = {  # a call on the '~' form of what was saved -> what it must find
    "list_checkpoints": (lambda: [c.step for c in list_checkpoints("~/run")], [1, 2, 3]),
    "latest_checkpoint": (lambda: getattr(latest_checkpoint("~/run"), "step", None), 3),
    "checkpoint_info": (lambda: getattr(checkpoint_info("~/run/step_2"), "step", None), 2),
    "prune": (
        lambda: sorted(os.path.basename(c.path) for c in prune("~/run", RetentionPolicy(keep_last=1)).deleted),
        ["step_1", "step_2"],
    ),
    "delete_checkpoint": (lambda: delete_checkpoint("~/run/step_1"), True),
}


@pytest.mark.parametrize("name", list(_FINDS))
def test_a_root_or_path_written_with_a_tilde_finds_what_a_save_of_that_id_wrote(
    run_under_home: Path, name: str
) -> None:
    call, expected = _FINDS[name]
    assert call() == expected
    if name in ("prune", "delete_checkpoint"):
        assert "step_1" not in _steps(run_under_home)


def test_collect_garbage_of_a_tilde_root_collects_there(run_under_home: Path) -> None:
    leftover = run_under_home / ".step_9.tmp-0123abcd-1"  # a dead save's temporary, marked as ours
    leftover.mkdir()
    (leftover / ".incomplete").write_bytes(b"")
    os.utime(leftover, (0, 0))
    collect_garbage("~/run", unowned_after_s=0)
    assert not leftover.exists()
    assert _steps(run_under_home) == ["step_1", "step_2", "step_3"]


def test_a_retention_policy_whose_root_starts_with_a_tilde_prunes_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    config = CheckpointManager.Config(retention=RetentionPolicy(keep_last=1, root="~/run")).with_sync_save()
    with CheckpointManager(config) as manager:
        for step in (1, 2, 3):
            manager.save(f"~/run/step_{step}", {"m": {"t": torch.ones(2)}})
    assert _steps(home / "run") == ["step_3"]
