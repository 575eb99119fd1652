"""A URL naming no bucket or path as `pathlib.Path` folds it (`Path("s3://")` is `s3:`, `Path("file://")` is
`file:`) is refused as a retention root or a protected id, as `s3://`, `s3:/` and `file://` are.

`Path(f"s3://{BUCKET}")` with BUCKET unset is `s3:`, no slash left: no URL to `url_scheme`, so the policy took it
as a local folder named `s3:` and every pass pruned that folder (none), silently, while the run's checkpoints
piled up; `protect=[Path(f"s3://{BUCKET}")]` protected nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy, prune

_FOLDED = [Path("s3://"), "s3:", Path("gs:///"), Path("file://"), "file:"]


@pytest.mark.parametrize("root", _FOLDED, ids=str)
def test_a_folded_url_root_naming_nothing_is_refused(root: str | Path) -> None:
    with pytest.raises(ConfigError, match=r"RetentionPolicy\.root .* names no directory"):
        RetentionPolicy(root=root, keep_last=1)


@pytest.mark.parametrize("protected", _FOLDED, ids=str)
def test_a_folded_url_protected_id_naming_nothing_is_refused(tmp_path: Path, protected: str | Path) -> None:
    with pytest.raises(ConfigError, match=r"protect="):
        prune(tmp_path, RetentionPolicy(keep_last=1), protect=[protected])


@pytest.mark.parametrize("root", ["runs", "./s3:", "runs/s3:", Path("s3://bucket"), "c:"], ids=str)
def test_a_local_folder_or_a_url_naming_a_bucket_is_still_taken(root: str | Path) -> None:
    assert RetentionPolicy(root=root, keep_last=1).root == root
