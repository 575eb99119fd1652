"""A user's file put, after a gc was killed, into the prefix that gc held: the next gc keeps it.

gc collects an earlier version's unfinished save (an empty marker: nothing records what it wrote) whole only
where every file there is one its manifest lists; it holds the id with its own claim first. Killed holding it,
it leaves that claim. A file a user adds there afterwards (`notes.txt`) is listed by no manifest of ours; the
next gc must keep it, naming it and the fix, as it does beside a save's dead claim (round 33).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3_server import S3Server, missing_s3_packages
from tests.test_gc_users_files_round33 import earlier_versions_killed_save
from tests.test_s3_gc_old_claim_takeover_round27 import _KILLED_GC
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import GcReport, collect_garbage

pytest.importorskip("fsspec")


def _kill_gc_holding(url: str, options: dict[str, object]) -> None:
    """gc of `url`/run in a child process, SIGKILLed once it holds the prefix it collects whole."""
    args = json.dumps({"url": url, "options": options})
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    gc = subprocess.run([sys.executable, "-c", _KILLED_GC, args], env=env, capture_output=True, timeout=120)
    assert gc.returncode == -signal.SIGKILL, gc.stderr.decode(errors="replace")[-2000:]


def _check_kept(report: GcReport) -> None:
    kept = {Path(leftover.path).name: why for leftover, why in report.kept}
    assert "notes.txt" in kept.get("z", "") and "by hand" in kept["z"], report  # named, with the fix
    assert "z" not in [Path(lo.path).name for lo in report.removed] and not report.failed, report


def test_fsspec_file_keeps_a_users_file_put_where_a_killed_gc_held_the_id(tmp_path: Path) -> None:
    """Defect: the next gc collected run/z whole, notes.txt with it."""
    config = FsspecStorageConfig(url=f"file://{tmp_path}")
    storage = config.create_storage()
    (tmp_path / "run" / "z").mkdir(parents=True)
    earlier_versions_killed_save(storage, config, "run/z")
    _kill_gc_holding(config.url, {})
    assert b'"collects"' in (tmp_path / "run/z" / INCOMPLETE_MARKER).read_bytes()  # gc's claim, up when killed
    (tmp_path / "run/z/notes.txt").write_text("mine")
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    assert (tmp_path / "run/z/notes.txt").read_text() == "mine", report
    _check_kept(report)


@pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")
def test_s3_keeps_a_users_file_put_where_a_killed_gc_held_the_id(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    earlier_versions_killed_save(storage, config, "run/z")
    _kill_gc_holding(config.url, s3_server.storage_options())
    assert b'"collects"' in storage.read(Path("run/z") / INCOMPLETE_MARKER)
    storage.write(Path("run/z/notes.txt"), b"mine")
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    assert storage.read(Path("run/z/notes.txt")) == b"mine", report
    _check_kept(report)
