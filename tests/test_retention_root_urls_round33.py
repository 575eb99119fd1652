"""A retention root spelt as a URL that names no directory is refused where the policy is built (round 33).

Round 33 refused an empty root when the policy is built: taken, every retention pass after every save failed
(a WARNING off the training thread) and no checkpoint was deleted until the disk filled. A `file://` root is
read as the path it names, and two spellings still did the same: `file://~/run` (the host `~`: every pass
failed with the readers' ConfigError) and `file://otherhost/run`; and `file://` (`f"file://{ROOT}"` with ROOT
unset) named the empty path, so each pass silently pruned the saved id's parent instead. A URL with nothing
after its scheme (`s3://`) names no bucket: every pass failed.

A `file:///abs` root a manager prunes under is still taken (real saves on the local disk).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy

_NAMES_NO_DIRECTORY = [
    pytest.param("file://~/run", id="file-host-tilde"),
    pytest.param("file://otherhost/run", id="file-host"),
    pytest.param("file://", id="file-empty"),
    pytest.param("s3://", id="s3-no-bucket"),
]


@pytest.mark.parametrize("root", _NAMES_NO_DIRECTORY)
def test_the_policy_is_refused_when_built_naming_the_root(root: str) -> None:
    with pytest.raises(ConfigError, match=r"RetentionPolicy\.root") as caught:
        RetentionPolicy(root=root, keep_last=1)
    assert repr(root) in str(caught.value)


@pytest.mark.parametrize("root", ["file:///abs/run", "file://localhost/abs/run", "s3://bucket", "s3://b/run"])
def test_a_url_naming_a_directory_is_still_taken(root: str) -> None:
    assert RetentionPolicy(root=root, keep_last=1).root == root


def test_a_local_file_url_root_still_prunes(tmp_path: Path) -> None:
    import torch

    from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        retention=RetentionPolicy(keep_last=1, root=f"file://{tmp_path}"),
    )
    with CheckpointManager(config) as manager:
        for step in (1, 2):
            manager.save(str(tmp_path / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]
