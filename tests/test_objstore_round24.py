"""Round 24: gc's own claim on a dead save's prefix (stores that record no writer per object: fsspec `file://`,
`memory://`, GCS, Azure) named no job, only gc's pid. A gc pass that failed midway (a delete the store refused)
left that claim behind, and while its process lived on (a trainer whose retention runs gc, a notebook), every
judge on the host took the claim for a live gc: saves of the id were refused and later gc passes kept the prefix,
for the 24 h a claim takes to age out. Now a gc pass holds a lock of its own for as long as it runs, and its
claim names it: once the pass is over (however it ended), the claim is dead to this process and to every other
on the host.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tests.test_objstore_round21 import _dead_pid, _manager, _root_url, _state
from tests.test_objstore_round22 import _assert_loads_whole, _env, _killed_save
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.commit import Claim, record_name
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CommitError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.fsspec_storage import FsspecStorage

pytest.importorskip("fsspec")

REPO = Path(__file__).resolve().parent.parent
_CHILD_TIMEOUT_S = 120

# gc whose delete of one of the dead save's files fails (a store refusing it): the pass ends with the prefix
# half collected and gc's claim on it. The process then lives on until the test lets it go.
_FAILING_GC_CHILD = r"""
import os, sys, time
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.retention import collect_garbage

url, done, go = sys.argv[1:4]

class RefusingOneDelete(LocalFileSystem):
    def rm_file(self, path):
        if os.path.basename(path) == "optim_0.pt":
            raise PermissionError(13, "Permission denied", path)
        return super().rm_file(path)

storage = FsspecStorageConfig(url=url, filesystem=RefusingOneDelete()).create_storage()
report = collect_garbage(url, storage, unowned_after_s=0)
with open(done, "w") as f:
    f.write(repr([l.path for l, _ in report.failed]))
deadline = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _refusing_gc(url: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """Runs the failing gc in a child process; returns it (alive, its pass over) and the file that lets it go."""
    done, go = tmp_path / "done", tmp_path / "go"
    child = subprocess.Popen(
        [sys.executable, "-c", _FAILING_GC_CHILD, url, str(done), str(go)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + _CHILD_TIMEOUT_S
    while not done.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "gc never ended its pass"
        time.sleep(0.05)
    assert "step_2" in done.read_text(), done.read_text()  # the pass failed on that prefix
    return child, go


def _storage(url: str) -> FsspecStorage:
    return FsspecStorageConfig(url=url).create_storage()


def _gc_claim(url: str, ckpt: str) -> Claim:
    path = Path(url.removeprefix("file://")) / ckpt / INCOMPLETE_MARKER
    claim = Claim.parse(path.read_bytes())
    assert claim is not None and claim.is_gc(), path.read_bytes()
    return claim


def test_a_failed_gc_pass_in_a_live_process_leaves_no_claim_that_blocks_the_id(tmp_path: Path) -> None:
    url, ckpt = _root_url("file", tmp_path), "step_2"
    _killed_save(url, ckpt, user={})
    child, go = _refusing_gc(url, tmp_path)
    try:
        assert _gc_claim(url, ckpt).pid == child.pid  # gc's claim is left, its process alive
        # Another process of the host: gc collects the prefix, and a save of the id then commits.
        report = collect_garbage(url, _storage(url), unowned_after_s=0)
        assert [Path(lo.path).name for lo in report.removed] == [ckpt], report
        with _manager(url) as manager:
            manager.save(ckpt, _state())
    finally:
        go.touch()
        child.communicate(timeout=_CHILD_TIMEOUT_S)
    _assert_loads_whole(url, ckpt)


def test_a_failed_gc_pass_leaves_no_claim_that_blocks_a_save_in_its_own_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsspec.implementations.local import LocalFileSystem

    url, ckpt = _root_url("file", tmp_path), "step_2"
    _killed_save(url, ckpt, user={})

    real_rm_file = LocalFileSystem.rm_file

    def refuse_one(self: LocalFileSystem, path: str, *args: object, **kwargs: object) -> None:
        if os.path.basename(path) == "optim_0.pt":  # as in the child above
            raise PermissionError(13, "Permission denied", path)
        real_rm_file(self, path, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "rm_file", refuse_one)
    failed = collect_garbage(url, _storage(url), unowned_after_s=0).failed
    assert [Path(lo.path).name for lo, _ in failed] == [ckpt] and "Permission denied" in failed[0][1], failed
    monkeypatch.undo()
    assert _gc_claim(url, ckpt).pid == os.getpid()
    with _manager(url) as manager:  # the pass is over: its claim is taken over, and the save commits whole
        manager.save(ckpt, _state())
    _assert_loads_whole(url, ckpt)


# ------------------------------------------------------- stores that cannot compare and delete in one step

_TWO_STEP_BUCKET = "r24-two-step"


class _TwoStepStore(MemoryFileSystem):  # type: ignore[misc]
    """An object store reached as `gs://` with no conditional delete or replace (what fsspec offers for GCS and
    Azure here): a marker's compare and its delete are two requests. In memory: no GCS can be reached from CI."""

    protocol = ("gs",)
    root_marker = ""


def _dead_claim_at(storage: FsspecStorage, ckpt: str) -> bytes:
    """A killed save's claim on `ckpt` (its pid gone on this host) and one file it recorded."""
    token = f".{ckpt}.tmp-0123456789ab-1"
    claim = Claim(token, "0123456789ab", socket.gethostname(), _dead_pid(), time.time(), records=True)
    storage.write(Path(ckpt) / INCOMPLETE_MARKER, claim.to_bytes())
    storage.write(Path(ckpt) / "model_0.pt", b"half a tensor")
    storage.write(
        Path(ckpt) / record_name(token, 0), json.dumps({"token": token, "rank": 0, "files": ["model_0.pt"]}).encode()
    )
    return claim.to_bytes()


def test_a_store_without_conditional_deletes_never_takes_a_dead_claim_over_in_two_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, on such a store a save (or gc) that judged a claim dead compared it, then deleted it and created
    its own: two that judged it at once could both pass the compare, and the second delete removed the first one's
    new claim (both then wrote the id; gc deleted the files of a save writing it). Now the take-over is refused
    with an error naming the marker and the fix, and gc leaves the prefix, saying why."""
    config = FsspecStorageConfig(url=f"gs://{_TWO_STEP_BUCKET}/run", filesystem=_TwoStepStore())
    storage = config.create_storage()
    marker = _dead_claim_at(storage, "step_2")
    manager = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config))
    with manager, pytest.raises(CommitError, match=r"gs://r24-two-step/run/step_2.*conditional"):
        manager.save("step_2", _state())
    assert storage.read(Path("step_2") / INCOMPLETE_MARKER) == marker  # the dead claim is as it was
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        report = collect_garbage(config.url, storage, unowned_after_s=0)
    assert report.removed == [], report
    assert storage.read(Path("step_2") / INCOMPLETE_MARKER) == marker
    assert storage.exists(Path("step_2/model_0.pt"))
    assert any("conditional" in r.getMessage() and "step_2" in r.getMessage() for r in caplog.records), caplog.text
