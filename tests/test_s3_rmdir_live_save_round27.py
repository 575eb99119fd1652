"""A removal of an id on S3 while a save of it runs in another process is refused, and the save goes on whole.

`rmdir` (`torch-checkpointing rm`, a script's cleanup, retention of another job) deleted every object under the
prefix, the running save's claim and files with it, and the save, knowing nothing of it, went on:
* held before its manifest, it committed a manifest whose files were gone, and said "committed";
* held before its claim's removal, it said "committed" over an id that held nothing.
The save runs in a real child process on the real test server, paused at one step of its commit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.s3_server import S3Server, missing_s3_packages
from tests.test_s3_attacks import _held_save, sync_manager
from torch_checkpointing.errors import ObjectStoreError

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")


@pytest.mark.parametrize("hold_on", ["data", "manifest", "marker"])
def test_removing_an_id_whose_save_is_running_is_refused_and_the_save_commits_whole(
    s3_server: S3Server, tmp_path: Path, hold_on: str
) -> None:
    """Defect: the rmdir returned, and then ("manifest") the save printed SAVED with only manifest.json left at
    the id, or ("marker") SAVED with nothing left at all."""
    config = s3_server.config()
    storage = config.create_storage()
    child = _held_save(s3_server, config, tmp_path, "run/z", hold_on)
    try:
        with pytest.raises(ObjectStoreError, match=r"run/z/\.incomplete is held by another save"):
            storage.rmdir(Path("run/z"))
    finally:
        (tmp_path / "release").touch()
        output = child.communicate(timeout=120)[0].decode(errors="replace")
    assert "SAVED" in output, output
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/z")["model"]["w"], torch.full((1000,), 1.0))
    storage.rmdir(Path("run/z"))  # once the save is done, the id goes as asked
    assert not storage.exists(Path("run/z/manifest.json"))
