"""What docs/operations.md says gc does with a manifest beside an empty `.incomplete` on an object store (round 30).

An earlier version marked a checkpoint it deleted with an empty `.incomplete`, and its saves claimed their id
with one: a delete interrupted before the manifest went, or a save killed between its manifest and its marker's
removal, left both. No claim is in such a marker, so it is dead: the folder is an unfinished delete or commit,
and gc removes it whole, manifest included; a committed checkpoint beside it stays.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.s3_server import S3Server, missing_s3_packages
from tests.test_s3_attacks import sync_manager
from torch_checkpointing import list_checkpoints
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.retention import collect_garbage

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")


def test_gc_removes_a_manifest_beside_an_empty_marker_whole(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        for name in ("run/a", "run/b"):
            manager.save(name, {"model": {"w": torch.ones(4)}})
    storage.write(Path("run/a/.incomplete"), b"")  # an earlier version's delete, interrupted after its marker
    root = f"{config.url}/run"
    assert [Path(c.path).name for c in list_checkpoints(root, storage)] == ["b"]
    assert [(o.kind, Path(o.path).name) for o in list_leftovers(root, storage)] == [("incomplete", "a")]
    report = collect_garbage(root, storage)
    assert [Path(o.path).name for o in report.removed] == ["a"] and not report.kept and not report.failed, report
    assert sorted(storage.ls(Path("run"))) == ["b"]
