"""Two deletes of one checkpoint on `file://`, the second finding the id emptied by the first, not yet removed.

Process B deletes `step_1` and is held right after the id's last file (its claim) went, its emptied folder not
yet removed; process A had copied `step_1` to its own trash before, and only then reaches the id. A's delete
fails there (the manifest is gone); it found its copy whole and the id "not whole" and put the copy back:
"Retention could not delete checkpoint step_1 (... its files were put back whole under step_1)", the
checkpoint B deleted listed and loaded again. The promise (docs/operations.md, "Two passes on one root"): a
pass that finds the checkpoint deleted by another drops its copy, says so at INFO, and puts nothing back. An
id that holds no file at all is deleted, as one not there at all is.

Real processes, held at chosen points by files they wait for, on real files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import _CHILD_TIMEOUT_S, REPO, _env, _plain_manager
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")

_DELETER = r"""
import logging, os, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.retention import delete_checkpoint
from torch_checkpointing.storage import fsspec_storage

role, url, sync = sys.argv[1:4]

def wait(name):
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(sync, name)) and time.monotonic() < deadline:
        time.sleep(0.01)

def touch(name):
    open(os.path.join(sync, name), "w").close()

class HeldAfterTheClaim(LocalFileSystem):
    # B: held once the id's claim (its last file) is gone, until A is done.
    def rm_file(self, path):
        out = super().rm_file(path)
        if role == "B" and os.path.basename(path) == ".incomplete" and ".trash-" not in path:
            touch("B_emptied")
            wait("A_done")
        return out

if role == "A":  # A: held once its copy is whole, until B emptied the id
    real = fsspec_storage._delete_prefix
    def held(backend, key, keys, **kwargs):
        if ".trash-" not in key:
            touch("A_copied")
            wait("B_emptied")
        return real(backend, key, keys, **kwargs)
    fsspec_storage._delete_prefix = held
else:
    wait("A_copied")
print(delete_checkpoint("step_1", FsspecStorageConfig(url=url, filesystem=HeldAfterTheClaim()).create_storage()))
if role == "A":
    touch("A_done")
"""


def test_a_delete_that_finds_the_id_emptied_by_another_puts_nothing_back(tmp_path: Path) -> None:
    url = _root_url("file", tmp_path)
    sync = tmp_path / "sync"
    sync.mkdir()
    with _plain_manager(url) as manager:
        manager.save("step_1", {"model": {"w": torch.arange(4.0)}})
        manager.save("step_2", {"model": {"w": torch.arange(2.0)}})
    a, b = (
        subprocess.Popen(
            [sys.executable, "-c", _DELETER, role, url, str(sync)],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for role in ("A", "B")
    )
    (a_out, a_err), (b_out, _) = (p.communicate(timeout=_CHILD_TIMEOUT_S) for p in (a, b))
    assert (a.returncode, b.returncode) == (0, 0), a_err.decode(errors="replace")[-2000:]
    assert b_out.split() == [b"True"] and a_out.split() == [b"False"], (a_out, b_out)
    warned = [line for line in a_err.decode().splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warned, warned  # the other process's delete is no failure of this one
    storage = FsspecStorageConfig(url=url).create_storage()
    assert [Path(info.path).name for info in list_checkpoints(url, storage)] == ["step_2"]
    report = collect_garbage(url, storage, unowned_after_s=0)
    assert not (report.kept or report.failed), report
    assert sorted(os.listdir(tmp_path / "run")) == ["step_2"]
    with _plain_manager(url) as manager:
        assert torch.equal(manager.load("step_2")["model"]["w"], torch.arange(2.0))
