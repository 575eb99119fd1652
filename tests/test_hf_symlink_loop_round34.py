"""An HF export's output or an import's folder that is (or lies under) a symbolic-link loop (round 34).

`export_hf` into such a path raised pathlib's bare `RuntimeError: Symlink loop from '...'` (the CLI: exit 2
with that line), and `import_hf` of one the OS's bare `[Errno 40] Too many levels of symbolic links`,
neither saying what to pass; a missing folder or a file there is named with the fix.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.hf import export_hf, import_hf


def _loop(tmp_path: Path) -> Path:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    return tmp_path / "a"


@pytest.mark.parametrize("under", [False, True])
def test_an_export_into_a_symlink_loop_names_the_output_and_the_fix(tmp_path: Path, under: bool) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "ck"), {"model": {"w": torch.ones(2)}})
    out = _loop(tmp_path) / "hf" if under else _loop(tmp_path)
    with pytest.raises(OSError, match="symbolic link") as raised:
        export_hf(tmp_path / "ck", "model", out)
    assert raised.value.errno == errno.ELOOP
    assert str(out) in str(raised.value) and "choose another output folder" in str(raised.value)


@pytest.mark.parametrize("under", [False, True])
def test_an_import_of_a_symlink_loop_names_the_folder_and_what_to_pass(tmp_path: Path, under: bool) -> None:
    folder = _loop(tmp_path) / "hf" if under else _loop(tmp_path)
    with pytest.raises(OSError, match="import_hf") as raised:
        import_hf(folder)
    assert raised.value.errno == errno.ELOOP
    assert str(folder) in str(raised.value) and "pass" in str(raised.value)
