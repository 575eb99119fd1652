"""A save killed right after it claims an id another save has just committed (round 16, object stores).

Save A passes the manager's checks of the id (nothing there yet); save B commits the id; A then creates its
`.incomplete` claim ("only if absent": B's own marker is gone by then) and is SIGKILLed before it looks for
B's manifest and lets go. The committed checkpoint was left with a manifest and a marker: `load` refused it as
incomplete, `latest_checkpoint` skipped it, and gc deleted it whole once A's claim was provably dead. The
manifest now names the claim of the save that committed it, so a marker holding another save's claim beside
it is a stray claim, not an unfinished commit: readers take the checkpoint as committed and gc removes only
the stray marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.s3_server import S3Server
from tests.test_s3_attacks import sync_manager
from torch_checkpointing import latest_checkpoint, list_checkpoints
from torch_checkpointing.retention import collect_garbage

REPO = Path(__file__).resolve().parent.parent

_CLAIMING_CHILD = r"""
import json, sys, time
from pathlib import Path
import pytest
import torch
from tests.s3_faults import HoldingS3FileSystem
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

a = json.loads(sys.argv[1])


class ClaimThenStall(HoldingS3FileSystem):
    def pipe_file(self, path, *args, **kwargs):
        out = super().pipe_file(path, *args, **kwargs)
        if path.endswith("/.incomplete"):
            Path(a["claimed"]).touch()  # the claim is made: the parent kills this process now
            time.sleep(600)
        return out


fs = ClaimThenStall(**a["options"], held_file=a["held"], release_file=a["release"], hold_on="claim")
config = FsspecStorageConfig(url=a["url"], filesystem=fs)
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
    m.save("run/x", {"model": {"w": torch.full((10,), 1.0)}})
"""


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the saving child ended early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def test_a_save_killed_right_after_claiming_a_just_committed_id_leaves_it_committed(
    s3_server: S3Server, tmp_path: Path
) -> None:
    config = s3_server.config()
    files = {k: str(tmp_path / k) for k in ("held", "release", "claimed")}
    args = {"options": s3_server.storage_options(), "url": config.url, **files}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CLAIMING_CHILD, json.dumps(args)], cwd=REPO, env=env)
    try:
        _wait_for(tmp_path / "held", child)  # A has checked the id and is about to claim it
        with sync_manager(config) as manager:
            manager.save("run/x", {"model": {"w": torch.full((10,), 2.0)}})  # B commits
        (tmp_path / "release").touch()
        _wait_for(tmp_path / "claimed", child)
    finally:
        child.kill()
        child.wait(timeout=60)

    storage = config.create_storage()
    root = f"{config.url}/run"
    with sync_manager(config) as manager:
        assert float(manager.load("run/x")["model"]["w"][0]) == 2.0  # was IncompleteCheckpointError
    latest = latest_checkpoint(root, storage)
    assert latest is not None and latest.path.endswith("run/x"), latest  # was None
    assert [Path(c.path).name for c in list_checkpoints(root, storage)] == ["x"]
    report = collect_garbage(root, storage, unowned_after_s=0)  # A's claim is provably dead now
    assert [o.kind for o in report.removed] == ["claim"], report  # was: the whole checkpoint, as incomplete
    x = Path(f"{root}/x")
    assert storage.exists(x / "manifest.json") and not storage.exists(x / ".incomplete")  # only the claim went
    with sync_manager(config) as manager:
        assert float(manager.load("run/x")["model"]["w"][0]) == 2.0
        manager.save("run/y", {"model": {"w": torch.full((10,), 3.0)}})  # the store is usable as before


def test_a_load_of_an_id_whose_save_is_running_says_it_may_still_commit_and_to_retry(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """On an object store a save writes under the id itself, behind its marker: a load meanwhile said "its save
    never committed. Load an earlier checkpoint.", which is false while that save runs, and gave no retry."""
    import threading

    from tests.s3_faults import HoldingS3FileSystem
    from torch_checkpointing import IncompleteCheckpointError
    from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

    config = s3_server.config()
    held, release = tmp_path / "held", tmp_path / "release"
    fs = HoldingS3FileSystem(
        **s3_server.storage_options(), held_file=str(held), release_file=str(release), hold_on="data"
    )
    saving = FsspecStorageConfig(url=config.url, filesystem=fs)
    failed: list[BaseException] = []

    def save() -> None:
        try:
            with sync_manager(saving) as manager:
                manager.save("run/z", {"model": {"w": torch.ones(4)}})
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=save)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not held.exists():
            assert thread.is_alive() and time.monotonic() < deadline, failed
            time.sleep(0.02)
        with sync_manager(config) as manager, pytest.raises(IncompleteCheckpointError) as caught:
            manager.load("run/z")
        said = str(caught.value)
        assert "still running" in said and "retry" in said.lower(), said
        assert "never committed" not in said, said
    finally:
        release.touch()
        thread.join(timeout=120)
    assert not failed, failed
    with sync_manager(config) as manager:  # the retry the message asks for
        assert torch.equal(manager.load("run/z")["model"]["w"], torch.ones(4))
