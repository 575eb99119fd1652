"""gc never removes a newer engine's committed checkpoint on an object store (round 25, manifest_version).

Since a manifest of a higher `manifest_version` is refused (a newer engine wrote it), gc judged the directory
beside a `.incomplete` marker by whether it holds a manifest this engine reads. A save of ours killed right after
claiming an id that a newer engine had just committed (the race of tests/test_s3_stray_claim_round16.py) left its
dead claim beside that checkpoint: gc then took the directory for an unfinished save whose claim is dead and
removed what saves wrote there, the newer engine's data files and manifest. Before the version was read, the
same checkpoint was committed and gc removed only the stray claim. What a marker beside a newer engine's
manifest means is that engine's to tell: gc leaves the directory alone, and `ls` names it as UNREADABLE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import s3fs
import torch

from tests.s3_server import S3Server
from tests.test_s3_attacks import sync_manager
from tests.test_s3_stray_claim_round16 import _CLAIMING_CHILD, REPO, _wait_for
from torch_checkpointing import checkpoint_writer
from torch_checkpointing import manifest as manifest_module
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def _newer_engine_commits_beside_a_dead_claim(
    s3_server: S3Server, config: FsspecStorageConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save of ours claims `run/x` right after a newer engine (version 2 manifests) committed it, and is killed."""
    files = {k: str(tmp_path / k) for k in ("held", "release", "claimed")}
    args = {"options": s3_server.storage_options(), "url": config.url, **files}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CLAIMING_CHILD, json.dumps(args)], cwd=REPO, env=env)
    try:
        _wait_for(tmp_path / "held", child)
        with monkeypatch.context() as newer, sync_manager(config) as manager:
            newer.setattr(manifest_module, "MANIFEST_VERSION", 2)  # this save is the newer engine's
            newer.setattr(checkpoint_writer, "__version__", "99.0.0")  # which says so in library_version
            manager.save("run/x", {"model": {"w": torch.full((10,), 2.0)}})
        (tmp_path / "release").touch()
        _wait_for(tmp_path / "claimed", child)
    finally:
        child.kill()
        child.wait(timeout=60)


def _names(s3_server: S3Server, prefix: str) -> list[str]:
    """The names of the objects under `prefix`, listed afresh (no cached listing)."""
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    return sorted(Path(key).name for key in fs.find(prefix))


def _in_a_newer_format(s3_server: S3Server, manifest_url: str) -> None:
    """Make the newer engine's manifest (version 1 this time) record its file in a format only it knows."""
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    d = json.loads(fs.cat(manifest_url))
    d["manifest_version"] = 1
    d["items"]["model"]["0"]["format"] = {"type": "ZstdTorchSerialization"}
    fs.pipe(manifest_url, json.dumps(d).encode())


@pytest.mark.parametrize("newer", ["manifest_version", "format"])
def test_gc_leaves_a_newer_engines_checkpoint_beside_a_dead_claim(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, newer: str
) -> None:
    """[format]: a newer engine's manifest of version 1 recording a format only it knows (round 26: no damage,
    ls 'unreadable') read as ours, so gc removed its marker as a stopped save's stray claim (that engine's to
    judge, as for a higher manifest_version)."""
    config = s3_server.config()
    _newer_engine_commits_beside_a_dead_claim(s3_server, config, tmp_path, monkeypatch)
    storage = config.create_storage()
    root = f"{config.url}/run"
    x = Path(f"{root}/x")
    if newer == "format":
        _in_a_newer_format(s3_server, f"{root}/x/manifest.json")
    written = _names(s3_server, f"{root}/x")
    assert "manifest.json" in written and "model_0.pt" in written and ".incomplete" in written, written
    assert json.loads(storage.read(x / "manifest.json"))["library_version"] == "99.0.0"
    for dry_run in (True, False):
        report = collect_garbage(root, storage, unowned_after_s=0, dry_run=dry_run)
        assert not [lo.path for lo in report.removed], report  # was: run/x removed as an unfinished save
    assert _names(s3_server, f"{root}/x") == written  # every file of it still there
