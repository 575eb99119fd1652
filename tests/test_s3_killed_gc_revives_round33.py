"""A gc killed while it holds an unfinished save's prefix never leaves that save a committed checkpoint.

gc holds a dead save's prefix with its own claim (a `gc-` token) before it removes a file. Killed there, beside
the manifest an earlier version's save wrote before it died (an empty marker: no token to name), the claim read
as "a stray claim beside a committed checkpoint": the next gc removed only the marker, and the unfinished save
listed, and loaded, as committed (on S3 and on fsspec `file://`). gc's claim only covers a prefix it collects.
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
from tests.test_s3_attacks import sync_manager
from tests.test_s3_gc_old_claim_takeover_round27 import _KILLED_GC
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.retention import collect_garbage

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")


def test_a_gc_killed_holding_an_earlier_versions_unfinished_save_never_commits_it(s3_server: S3Server) -> None:
    """Defect: after the killed gc, the next one logged "gc removed a stopped save's claim ... beside a committed
    checkpoint", and run/z listed and loaded as committed."""
    config = s3_server.config()
    storage = config.create_storage()
    earlier_versions_killed_save(storage, config, "run/z")
    _kill_gc_holding(config.url, s3_server.storage_options())
    assert storage.read(Path("run/z/.incomplete")).startswith(b"{")  # gc's claim was up when it was killed
    # The killed save is no checkpoint: not listed, not the latest, not loaded.
    assert [Path(c.path).name for c in list_checkpoints(f"{config.url}/run", storage)] == ["z-source"]
    with sync_manager(config) as manager, pytest.raises(CheckpointError):
        manager.load("run/z")
    report = collect_garbage(f"{config.url}/run", storage)
    assert "z" in [Path(lo.path).name for lo in report.removed], report
    assert not storage.exists(Path("run/z"))


def _kill_gc_holding(url: str, options: dict[str, object]) -> None:
    """Run gc of `url`/run in a child process, SIGKILLed once it holds the prefix it collects whole."""
    args = json.dumps({"url": url, "options": options})
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    gc = subprocess.run([sys.executable, "-c", _KILLED_GC, args], env=env, capture_output=True, timeout=120)
    assert gc.returncode == -signal.SIGKILL, gc.stderr.decode(errors="replace")[-2000:]


def test_fsspec_file_a_gc_killed_holding_an_earlier_versions_unfinished_save_never_commits_it(tmp_path: Path) -> None:
    config = FsspecStorageConfig(url=f"file://{tmp_path}")
    storage = config.create_storage()
    (tmp_path / "run" / "z").mkdir(parents=True)
    earlier_versions_killed_save(storage, config, "run/z")
    _kill_gc_holding(config.url, {})
    assert (tmp_path / "run/z/.incomplete").read_bytes().startswith(b"{")  # gc's claim was up when it was killed
    assert [Path(c.path).name for c in list_checkpoints(f"{config.url}/run", storage)] == ["z-source"]
    report = collect_garbage(f"{config.url}/run", storage)
    assert "z" in [Path(lo.path).name for lo in report.removed], report
    assert not storage.exists(Path("run/z"))
