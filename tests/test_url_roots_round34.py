"""A URL naming no bucket in the one-slash spelling (`s3:/`, which `pathlib.Path` folds `s3://` URLs into and
which every reader takes as a URL) is refused as a retention root or a protected id, as `s3://` is.

Round 33 refused `s3://` but looked for `://` first, so `s3:/` was taken: a policy with that root failed every
pass after every save, and a protected id so spelt protected nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy, prune


@pytest.mark.parametrize("root", ["s3:/", "S3:/", "gs:/", "s3:///"])
def test_a_root_naming_no_bucket_is_refused_in_either_spelling(root: str) -> None:
    with pytest.raises(ConfigError, match=r"RetentionPolicy\.root .* names no directory"):
        RetentionPolicy(root=root, keep_last=1)


@pytest.mark.parametrize("protected", ["s3:/", "gs:/"])
def test_a_protected_id_naming_no_bucket_is_refused_in_either_spelling(tmp_path: Path, protected: str) -> None:
    with pytest.raises(ConfigError, match=r"protect="):
        prune(tmp_path, RetentionPolicy(keep_last=1), protect=[protected])


@pytest.mark.parametrize("root", ["s3:/bucket", "s3:/bucket/run", "file:/abs/run", "file:/"])
def test_a_one_slash_url_naming_a_directory_is_still_taken(root: str) -> None:
    assert RetentionPolicy(root=root, keep_last=1).root == root
