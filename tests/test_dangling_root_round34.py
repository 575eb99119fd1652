"""A root that is a symbolic link to nothing (an unmounted volume, a moved run folder) is refused by the readers.

A missing root lists nothing, which a resume takes for a first run; a root that is a link whose target is gone
is no first run: `latest_checkpoint(root)` returned None with no word, and the job started over from step 0 (the
CLI already said "no such directory"). Now it raises FileNotFoundError naming the link and where it points.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torch_checkpointing import latest_checkpoint, list_checkpoints
from torch_checkpointing.retention import RetentionPolicy, collect_garbage, prune


@pytest.fixture
def dangling(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    os.symlink(tmp_path / "unmounted" / "run", root)
    return root


def test_latest_checkpoint_refuses_a_dangling_root(dangling: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{dangling}.*symbolic link to .*unmounted/run.* does not exist"):
        latest_checkpoint(dangling)


def test_the_other_readers_refuse_it_too(dangling: Path) -> None:
    with pytest.raises(FileNotFoundError, match="symbolic link"):
        list_checkpoints(str(dangling))
    with pytest.raises(FileNotFoundError, match="symbolic link"):
        prune(dangling, RetentionPolicy(keep_last=1), dry_run=True)
    with pytest.raises(FileNotFoundError, match="symbolic link"):
        collect_garbage(dangling)


def test_a_missing_root_is_still_a_first_run(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "not_yet") is None
    assert list_checkpoints(tmp_path / "not_yet") == []
