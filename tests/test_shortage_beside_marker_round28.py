"""A process short of descriptors while gc or a listing reads a manifest beside a marker (round 28).

On an object store, a committed checkpoint with another save's stray claim beside it (a save killed right
after claiming the id: tests/test_s3_stray_claim_round16.py) is committed, and gc removes only the claim once it
is dead. The manifest read that tells so swallowed every `OSError`: a process out of file descriptors at that
one read (EMFILE) took the checkpoint for an unfinished save whose claim is dead, and gc removed it whole. A
shortage is never judged as damage or as "unfinished": it is raised, and the checkpoint is left as it is.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import s3fs
import torch

from tests.s3_server import S3Server
from tests.test_s3_attacks import sync_manager
from torch_checkpointing.commit import STALE_CLAIM_S, Claim
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.base_storage import Storage

_DEAD_CLAIM = Claim(token="tmp-deadjob-1", uid="deadjob", host="elsewhere", pid=1, created=0.0)


def _committed_beside_a_dead_claim(s3_server: S3Server) -> tuple[str, list[str]]:
    """`run/x` committed, with another save's claim (older than any save: dead) beside its manifest."""
    config = s3_server.config()
    root = f"{config.url}/run"
    with sync_manager(config) as manager:
        manager.save(f"{root}/x", {"model": {"w": torch.full((10,), 1.0)}})
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    assert _DEAD_CLAIM.created < STALE_CLAIM_S
    fs.pipe(f"{root}/x/.incomplete", _DEAD_CLAIM.to_bytes())
    return root, _names(s3_server, f"{root}/x")


def _names(s3_server: S3Server, prefix: str) -> list[str]:
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    return sorted(Path(key).name for key in fs.find(prefix))


def _out_of_descriptors_reading(storage: Storage, name: str) -> list[str]:
    """Make every read of a file called `name` fail as a process out of descriptors does (EMFILE), by whichever
    of the storage's read calls the engine reads it with (`read_sized` since manifests are read as one version);
    returns the paths refused, so that a test knows the shortage was met."""
    refused: list[str] = []

    def shorted(read: Any) -> Any:
        def short(path: Any, *args: Any, **kwargs: Any) -> Any:
            if Path(str(path)).name == name:
                refused.append(str(path))
                raise OSError(errno.EMFILE, "Too many open files")
            return read(path, *args, **kwargs)

        return short

    for method in ("read", "read_range", "read_sized"):
        setattr(storage, method, shorted(getattr(storage, method)))
    return refused


def test_gc_short_of_descriptors_at_the_manifest_leaves_a_committed_checkpoint(s3_server: S3Server) -> None:
    root, written = _committed_beside_a_dead_claim(s3_server)
    assert "manifest.json" in written and ".incomplete" in written, written
    storage = s3_server.config().create_storage()
    refused = _out_of_descriptors_reading(storage, "manifest.json")
    for dry_run in (True, False):
        with pytest.raises(OSError) as caught:
            collect_garbage(root, storage, unowned_after_s=0, dry_run=dry_run)
        assert caught.value.errno == errno.EMFILE, caught.value  # was: run/x removed whole, as an unfinished save
        assert "manifest.json" in str(caught.value) and "ulimit -n" in str(caught.value)
    assert refused
    assert _names(s3_server, f"{root}/x") == written


def test_listing_short_of_descriptors_does_not_call_a_committed_checkpoint_unfinished(s3_server: S3Server) -> None:
    root, _ = _committed_beside_a_dead_claim(s3_server)
    storage = s3_server.config().create_storage()
    _out_of_descriptors_reading(storage, "manifest.json")
    with pytest.raises(OSError) as caught:
        list_leftovers(root, storage)  # was: [Leftover(kind='incomplete', ...)] for run/x
    assert caught.value.errno == errno.EMFILE


def test_gc_without_shortage_removes_only_the_dead_claim(s3_server: S3Server) -> None:
    """The same checkpoint read without a shortage: only its stray claim goes (the premise of the tests above)."""
    root, written = _committed_beside_a_dead_claim(s3_server)
    report = collect_garbage(root, s3_server.config().create_storage(), unowned_after_s=0)
    assert [lo.kind for lo in report.removed] == ["claim"], report
    assert _names(s3_server, f"{root}/x") == [n for n in written if n != ".incomplete"]


_SHORT_CHILD = r"""
import errno, os, resource, sys
from pathlib import Path
from torch_checkpointing.asides import replace_under_way
from torch_checkpointing.discovery import owner_alive
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

root, uid = Path(sys.argv[1]), sys.argv[2]
storage = LocalFileSystemStorageConfig().create_storage()
held = []
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError as exc:
    assert exc.errno == errno.EMFILE, exc
checks = {"owner_alive": lambda: owner_alive(uid), "replace_under_way": lambda: replace_under_way(storage, root / "x")}
for name, call in checks.items():
    try:
        print(name, "RETURNED", call())
    except OSError as exc:
        print(name, "RAISED", exc.errno, "ulimit -n" in str(exc))
"""


def test_job_and_replace_checks_short_of_descriptors_are_raised(tmp_path: Path) -> None:
    """An owner lock that cannot be opened for want of descriptors was "judged by age" (gc could remove a live
    save's temporary), and a listing of the parent that failed so was "no replace under way" (a load in a
    replace's gap said the checkpoint did not exist): both are this process's shortage, raised as one."""
    import os
    import subprocess
    import sys

    from torch_checkpointing.discovery import owner_lock_path

    locks = tmp_path / "locks"
    env = {**os.environ, "TORCH_CHECKPOINTING_LOCK_DIR": str(locks)}
    os.makedirs(locks)
    uid = "round28job"
    Path(os.path.join(locks, Path(owner_lock_path(uid)).name)).touch()
    out = subprocess.run(
        [sys.executable, "-c", _SHORT_CHILD, str(tmp_path), uid], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert said == {"owner_alive": f"RAISED {errno.EMFILE} True", "replace_under_way": f"RAISED {errno.EMFILE} True"}
