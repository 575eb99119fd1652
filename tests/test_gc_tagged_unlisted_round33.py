"""gc never deletes a user's file beside a dead tagged claim on a store that cannot list what the save wrote.

A save's claim that says its uploads are tagged (`"tags": true`, S3's per-object record) lets gc tell the
save's objects from a user's. Where the store gives no such listing (`objects_by_save` None: the claim read off
S3, on `file://`), gc collected the prefix whole, a user's `notes.txt` with it. Now, as for an empty marker
(test_gc_users_files_round33), the prefix is kept whole and the files nothing tells apart as ours are named.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.commit import Claim
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(60)
    return proc.pid


def _dead_tagged_claim() -> bytes:
    claim = Claim("save-" + "0" * 32, "", socket.gethostname(), _a_dead_pid(), time.time() - 60, tags=True)
    return claim.to_bytes()


def test_fsspec_file_keeps_a_users_file_beside_a_dead_tagged_claim(tmp_path: Path) -> None:
    """Defect: gc removed run/x whole, notes.txt with it."""
    folder = tmp_path / "run" / "x"
    folder.mkdir(parents=True)
    (folder / INCOMPLETE_MARKER).write_bytes(_dead_tagged_claim())
    (folder / "notes.txt").write_text("mine")
    storage = FsspecStorageConfig(url=f"file://{tmp_path}").create_storage()
    report = collect_garbage(f"file://{tmp_path}/run", storage, unowned_after_s=0)
    assert (folder / "notes.txt").read_text() == "mine", report
    ((leftover, why),) = report.kept
    assert Path(leftover.path).name == "x" and "notes.txt" in why and not report.removed, report


def test_fsspec_file_still_collects_a_lone_dead_tagged_claim(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "x"
    folder.mkdir(parents=True)
    (folder / INCOMPLETE_MARKER).write_bytes(_dead_tagged_claim())
    storage = FsspecStorageConfig(url=f"file://{tmp_path}").create_storage()
    report = collect_garbage(f"file://{tmp_path}/run", storage, unowned_after_s=0)
    assert [Path(lo.path).name for lo in report.removed] == ["x"] and not report.kept, report
    assert not folder.exists()
