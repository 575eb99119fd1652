"""A retention root spelt as a `file://` URL naming a host is refused where the policy is built.

`RetentionPolicy(root="file://~/run")` (the host `~`: two slashes, not three) was accepted; every retention
pass after a save then failed with a WARNING off the training thread, and no checkpoint was ever deleted.
"""

from __future__ import annotations

import pytest

from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy


@pytest.mark.parametrize("root", ["file://~/run", "file://host/run", "local://~/run"])
def test_a_file_url_root_naming_a_host_is_refused_when_built(root: str) -> None:
    with pytest.raises(ConfigError, match=r"RetentionPolicy\.root.*three slashes"):
        RetentionPolicy(root=root, keep_last=1)


@pytest.mark.parametrize("root", ["file:///abs/run", "file://localhost/abs/run", "~/run"])
def test_a_file_url_root_naming_a_local_path_is_taken(root: str) -> None:
    assert RetentionPolicy(root=root, keep_last=1).root == root
