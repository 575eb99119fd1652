"""A path no file system can name (a lone surrogate) is refused naming the item or the checkpoint (round 32).

`os.fsencode` writes a str path with "surrogateescape", which carries only the surrogates U+DC80..U+DCFF (the
bytes a non-UTF-8 name decoded to); any other surrogate cannot become bytes. Round 31's name-length check of a
layout, run when a manager is built, encoded the path and raised a bare UnicodeEncodeError from
`CheckpointManager(config)`; before, the save raised it, naming neither the item nor the fix. A manifest read
back may hold one too (JSON's `\ud800` escape): the load's one check of a path read from checkpoint data refuses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec, latest_checkpoint, list_checkpoints
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.errors import ConfigError, UnsafeCheckpointError
from torch_checkpointing.retention import collect_garbage


def _config(path: str) -> CheckpointManager.Config:
    config = CheckpointManager.Config.with_sync_save()
    config.items = {"m": ItemSpec(layout=LayoutInfo(path, TorchSerialization()))}
    return config


@pytest.mark.parametrize("path", ["a\ud800.pt", "sub\udbff/m.pt"], ids=["high", "in-a-folder"])
def test_a_path_with_a_lone_surrogate_is_warned_at_build_and_refused_at_save(
    tmp_path: Path, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: CheckpointManager(config) raised "UnicodeEncodeError: 'utf-8' codec can't encode character
    '\\ud800' in position 1: surrogates not allowed"."""
    with caplog.at_level("WARNING", logger="torch_checkpointing"):
        manager = CheckpointManager(_config(path))
    try:
        assert any("Config.items['m']" in r.getMessage() and "surrogate" in r.getMessage() for r in caplog.records)
        with pytest.raises(ConfigError, match=r"key 'm'.*surrogate"):
            manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}})
    finally:
        manager.close()
    assert list_checkpoints(tmp_path) == []


def test_a_non_utf8_name_a_file_system_holds_is_still_taken(tmp_path: Path) -> None:
    """'\\udcff' is the byte 0xff of a name that is no UTF-8: os.fsencode gives it back, and Linux takes it."""
    with CheckpointManager(_config("m\udcff.pt")) as manager:
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}})
        assert torch.equal(manager.load(str(tmp_path / "ck"))["m"]["x"], torch.ones(2))
    assert (tmp_path / "ck" / "m\udcff.pt").exists()


def _crafted(tmp_path: Path) -> Path:
    """A committed checkpoint whose manifest names its item file with a lone surrogate (a JSON escape)."""
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}})
    manifest = tmp_path / "ck" / "manifest.json"
    text = manifest.read_text()
    assert text.count('"m_0.pt"') == 1
    manifest.write_text(text.replace('"m_0.pt"', '"m_0\\ud800.pt"'))
    return tmp_path / "ck"


def test_a_manifest_path_with_a_lone_surrogate_is_refused_as_unsafe(tmp_path: Path) -> None:
    """Defect: the load raised a bare UnicodeEncodeError from os.open, naming neither the checkpoint nor the
    manifest, and `verify` said only "error: 'utf-8' codec can't encode character"."""
    path = _crafted(tmp_path)
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    with manager, pytest.raises(UnsafeCheckpointError, match=r"surrogate"):
        manager.load(str(path))


@pytest.mark.parametrize("call", ["save", "load"])
def test_a_checkpoint_id_with_a_lone_surrogate_is_refused_naming_it(tmp_path: Path, call: str) -> None:
    """Defect: save() and load() raised a bare UnicodeEncodeError ("surrogates not allowed") from deep inside."""
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    with manager, pytest.raises(ConfigError, match=r"Checkpoint id .*surrogate"):
        if call == "save":
            manager.save(str(tmp_path / "c\ud800"), {"m": {"x": torch.ones(2)}})
        else:
            manager.load(str(tmp_path / "c\ud800"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("call", [list_checkpoints, latest_checkpoint, collect_garbage], ids=lambda f: f.__name__)
def test_a_root_with_a_lone_surrogate_is_refused(tmp_path: Path, call: Any) -> None:
    """Defect: list_checkpoints gave [], latest_checkpoint None and collect_garbage "nothing to collect" (the
    directory test took the path's encoding error for "no such directory"): a resume started from scratch."""
    with pytest.raises(ConfigError, match="surrogate"):
        call(str(tmp_path / "run\ud800"))


def test_a_staging_dir_with_a_lone_surrogate_is_refused_by_the_config(tmp_path: Path) -> None:
    """Defect: taken; the first staged save raised a bare UnicodeEncodeError from tempfile.mkstemp."""
    from torch_checkpointing.staging import CheckpointStagerConfig

    with pytest.raises(ConfigError, match=r"staging_dir.*surrogate"):
        CheckpointStagerConfig(staging_dir=str(tmp_path / "s\ud800"))


def test_hf_directories_with_a_lone_surrogate_are_refused(tmp_path: Path) -> None:
    """Defect: import_hf raised a bare UnicodeEncodeError; export_hf would create its output only to raise one."""
    from torch_checkpointing.hf import export_hf, import_hf

    with pytest.raises(ConfigError, match="surrogate"):
        import_hf(str(tmp_path / "hf\ud800"))
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(str(tmp_path / "ck"), {"m": {"x": torch.ones(2)}})
    with pytest.raises(ConfigError, match="surrogate"):
        export_hf(str(tmp_path / "ck"), "m", str(tmp_path / "out\ud800"))
