"""Round 22: an `.incomplete` beside a committed checkpoint's manifest that is not a regular file (a FIFO, a
directory, a symbolic link) is no marker the engine could have written.

On a store without local paths (fsspec `file://`) a FIFO or a link read as an EMPTY marker (fsspec sizes a FIFO
0 bytes and follows the link), which the engine's protocol reads as "a delete is under way": gc then tried to
collect the committed checkpoint, and failed only because moving a FIFO aside fails. Listings skipped it at
DEBUG as if it were being deleted. Now both stores refuse such a marker: gc leaves the checkpoint alone, and a
listing skips it with a WARNING naming the file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_checkpoints, list_leftovers
from torch_checkpointing.errors import UnsafeCheckpointError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.fsspec_storage import FsspecStorage

pytest.importorskip("fsspec")

STORES = ["fsspec-file", "local"]
ODD_MARKERS = ["fifo", "directory", "symlink"]


def _committed(store: str, tmp_path: Path) -> tuple[str, Storage | None, Path]:
    """A committed checkpoint `step_1` under a run root: the root as the store takes it, the store (None: the
    plain local one), and the checkpoint's directory on disk."""
    run = tmp_path / "run"
    if store == "local":
        with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
            manager.save(str(run / "step_1"), {"x": torch.arange(3.0)})
        return str(run), None, run / "step_1"
    config = FsspecStorageConfig(url=f"file://{run}")
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
        m.save("step_1", {"x": torch.arange(3.0)})
    return f"file://{run}", FsspecStorage(config), run / "step_1"


def _plant(kind: str, ckpt: Path, tmp_path: Path) -> Path:
    """An `.incomplete` in `ckpt` that is no regular file: a FIFO, a directory, or a link to an empty file."""
    marker = ckpt / INCOMPLETE_MARKER
    if kind == "fifo":
        os.mkfifo(marker)
    elif kind == "directory":
        marker.mkdir()
    else:
        (tmp_path / "empty").write_bytes(b"")
        os.symlink(tmp_path / "empty", marker)
    return marker


def _listing(ckpt: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for name in sorted(os.listdir(ckpt)):
        p = ckpt / name
        out[name] = "link" if p.is_symlink() else ("other" if not p.is_file() else p.read_bytes())
    return out


@pytest.mark.parametrize("kind", ODD_MARKERS)
@pytest.mark.parametrize("store", STORES)
def test_gc_never_collects_a_committed_checkpoint_for_an_odd_marker(store: str, kind: str, tmp_path: Path) -> None:
    """Before, on fsspec `file://` the FIFO and the link were "an incomplete of ours" and gc tried to move the
    committed checkpoint aside (`failed` held it; only the FIFO's move failing saved it)."""
    root, storage, ckpt = _committed(store, tmp_path)
    _plant(kind, ckpt, tmp_path)
    before = _listing(ckpt)
    assert [o.recognised for o in list_leftovers(root, storage)] == [False]
    report = collect_garbage(root, storage, unowned_after_s=0)
    assert report.removed == [] and report.failed == []
    assert _listing(ckpt) == before
    assert (tmp_path / "run").exists() and sorted(os.listdir(tmp_path / "run")) == ["step_1"]


@pytest.mark.parametrize("kind", ODD_MARKERS)
@pytest.mark.parametrize("store", STORES)
def test_a_listing_warns_of_an_odd_marker_by_name(
    store: str, kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the checkpoint left every listing at DEBUG, read as a delete under way."""
    root, storage, ckpt = _committed(store, tmp_path)
    marker = _plant(kind, ckpt, tmp_path)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert list_checkpoints(root, storage) == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(marker) in msg and "not a regular file" in msg for msg in warned), warned


@pytest.mark.parametrize("kind", ODD_MARKERS)
@pytest.mark.parametrize("store", STORES)
def test_a_load_refuses_an_odd_marker_by_name(store: str, kind: str, tmp_path: Path) -> None:
    """Before, the load said the checkpoint was incomplete ("a delete of it is under way" on `file://`), naming
    neither the odd file nor the fix; now, as a listing does, it names the marker as no regular file."""
    root, _, ckpt = _committed(store, tmp_path)
    marker = _plant(kind, ckpt, tmp_path)
    save = SyncCheckpointSaverConfig()
    config = (
        CheckpointManager.Config(save=save)
        if store == "local"
        else CheckpointManager.Config(save=save, storage_config=FsspecStorageConfig(url=root))
    )
    with CheckpointManager(config) as manager, pytest.raises(UnsafeCheckpointError) as refused:
        manager.load(str(ckpt) if store == "local" else "step_1", {"x": torch.zeros(3)})
    assert str(marker) in str(refused.value) and "not a regular file" in str(refused.value)
