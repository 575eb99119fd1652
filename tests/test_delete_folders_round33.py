"""`delete_checkpoint` of a directory with no manifest that holds only folders deletes nothing.

Round 32 made an empty folder inside a checkpoint "not part of it" (a save refuses to replace it, retention to
delete it). Without a manifest, though, every file counted as not ours but folders were skipped, so a directory
holding only empty folders had nothing "not ours" in it: `delete_checkpoint` renamed it to a trash name and
removed it (`notes/empty/`), or, for a folder named `.incomplete`, moved it aside, failed to remove it ("Is a
directory ... `torch-checkpointing gc` will retry", where gc then keeps it for good), and returned True. A save
to the same id refuses it as "not a checkpoint"; a delete must not remove what a save would not replace.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from torch_checkpointing.retention import delete_checkpoint


@pytest.mark.parametrize("folder", ["notes/empty", ".incomplete", "sub"])
def test_a_directory_of_folders_without_a_manifest_is_not_deleted(
    tmp_path: Path, folder: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "run" / "step_1" / folder).mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert delete_checkpoint(tmp_path / "run" / "step_1") is False
    assert (tmp_path / "run" / "step_1" / folder).is_dir()
    assert os.listdir(tmp_path / "run") == ["step_1"]  # nothing moved aside
    assert any(f"{folder}/" in r.getMessage() for r in caplog.records), caplog.text
