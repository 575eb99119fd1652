"""gc's claim as an earlier build wrote it, found beside the manifest of the save that gc was collecting.

Before gc's claim named the save it collects (`"collects"`), gc held a dead save's prefix with a claim of a `gc-`
token and no such field, then deleted that save's manifest and files. A save killed after writing its manifest
(as it removed its marker) is no checkpoint; an earlier build's gc SIGKILLed while it held that save's id left the
manifest beside its own claim. Read by this build, that claim must keep the id unfinished (never listed, never
loaded), and the next gc must remove the save, never let go of the claim alone and so commit it for good.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.s3_server import S3Server, missing_s3_packages
from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22_review import _killed_at
from tests.test_s3_attacks import sync_manager
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.commit import Claim
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.manifest import GC_TOKEN_PREFIX, INCOMPLETE_MARKER, Manifest, stray_claim
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(60)
    return proc.pid


def _earlier_builds_gc_claim() -> bytes:
    """The claim an earlier build's gc put up (`Claim.for_gc()` then): a `gc-` token, records, no `collects`;
    its process gone."""
    claim = Claim(f"{GC_TOKEN_PREFIX}{'1' * 32}", "", socket.gethostname(), _a_dead_pid(), time.time(), records=True)
    fields = dataclasses.asdict(claim)
    del fields["collects"]
    return json.dumps(fields, sort_keys=True).encode("utf-8")


def test_an_earlier_builds_gc_claim_beside_a_manifest_is_no_stray_claim() -> None:
    manifest = Manifest(world_size=1, library_version="0", files=(), claim="save-A")
    assert not stray_claim(_earlier_builds_gc_claim(), manifest)


def test_fsspec_file_a_killed_save_held_by_an_earlier_builds_gc_never_becomes_a_checkpoint(tmp_path: Path) -> None:
    """Defect: run/step_3 listed as committed, and the next gc removed the claim alone, committing it for good."""
    url, ckpt = _root_url("file", tmp_path), "step_3"
    storage = FsspecStorageConfig(url=url).create_storage()
    _killed_at("save", url, ckpt, INCOMPLETE_MARKER)  # its manifest written, its claim still up: not committed
    prefix = tmp_path / "run" / ckpt
    assert not list_checkpoints(url, storage)
    (prefix / INCOMPLETE_MARKER).write_bytes(_earlier_builds_gc_claim())  # that build's gc, SIGKILLed holding it
    assert not list_checkpoints(url, storage)
    report = collect_garbage(url, storage, unowned_after_s=0)
    assert [Path(lo.path).name for lo in report.removed] == [ckpt] and not report.failed, report
    assert not list_checkpoints(url, storage)
    assert not prefix.exists() or not os.listdir(prefix), os.listdir(prefix)


@pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")
def test_s3_a_save_held_by_an_earlier_builds_gc_never_becomes_a_checkpoint(s3_server: S3Server) -> None:
    """The same on S3: the save's manifest (its token in it), the earlier build's gc claim beside it."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/z", {"x": 1})
    storage.write(Path("run/z") / INCOMPLETE_MARKER, _earlier_builds_gc_claim())
    assert not list_checkpoints(f"{config.url}/run", storage)
    with sync_manager(config) as manager, pytest.raises(CheckpointError):
        manager.load("run/z")
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    assert [Path(lo.path).name for lo in report.removed] == ["z"] and not report.failed, report
    assert not list_checkpoints(f"{config.url}/run", storage)
    assert not storage.exists(Path("run/z"))
