"""A retention root that can name no path is refused where the policy is built.

`RetentionPolicy(root="")` and a root holding a lone surrogate were taken when the policy was built, and by the
manager built on it; every retention pass after a save then failed (a WARNING off the training thread) and no
checkpoint was ever deleted until the disk filled.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy

_NO_PATH = [pytest.param("", id="empty"), pytest.param("run/\ud800", id="surrogate")]


@pytest.mark.parametrize("root", [*_NO_PATH, pytest.param(Path("run/\udfff"), id="Path-surrogate")])
def test_a_policy_root_that_names_no_path_is_refused_when_built(root: str | os.PathLike[str]) -> None:
    with pytest.raises(ConfigError, match=r"RetentionPolicy\.root"):
        RetentionPolicy(root=root, keep_last=1)
