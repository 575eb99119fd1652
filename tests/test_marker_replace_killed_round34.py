"""A process SIGKILLed inside a claim's conditional replace on `file://` (gc holding a dead save's id).

`replace_object` off S3 compared the marker, deleted it, then created the new one. A process killed between
the delete and the create left no marker at all. Beside a dead save's manifest (the save killed as it removed
its marker) gc's replace, holding the id to collect it, made that killed save a committed checkpoint: listed,
the latest, loaded. Now the new claim is written under a hidden name and renamed over the marker in one step:
killed before the rename, the old claim is still there (and the hidden bytes go at the next create or replace).

Real processes killed with SIGKILL at a chosen call, on real files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_objstore_round21 import _root_url
from tests.test_objstore_round22 import _plain_manager, _run_until_sigkilled
from tests.test_objstore_round22_review import _killed_at
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.commit import Claim
from torch_checkpointing.discovery import list_checkpoints
from torch_checkpointing.errors import IncompleteCheckpointError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")

# gc, SIGKILLed once the first filesystem call that changes the marker's name (a delete, a link, a rename)
# has returned: what a kill right after it leaves.
_KILLED_AFTER_MARKER_CHANGE = r"""
import os, signal, sys
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.retention import collect_garbage

url = sys.argv[1]
marker = os.path.join(sys.argv[2], ".incomplete")

def killed_after(real):
    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        if any(isinstance(a, str) and os.path.abspath(a) == marker for a in args[:2]) or (
            len(args) > 1 and args[1] == ".incomplete"
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return call

for name in ("unlink", "remove", "link", "rename", "replace"):
    setattr(os, name, killed_after(getattr(os, name)))
collect_garbage(url, FsspecStorageConfig(url=url).create_storage(), unowned_after_s=0)
"""


def test_a_gc_killed_inside_its_claims_replace_never_commits_the_dead_save(tmp_path: Path) -> None:
    url, ckpt = _root_url("file", tmp_path), "step_3"
    storage = FsspecStorageConfig(url=url).create_storage()
    prefix = tmp_path / "run" / ckpt
    _killed_at("save", url, ckpt, INCOMPLETE_MARKER)
    dead = (prefix / INCOMPLETE_MARKER).read_bytes()
    assert {"manifest.json", INCOMPLETE_MARKER} <= set(os.listdir(prefix)), os.listdir(prefix)
    _run_until_sigkilled(_KILLED_AFTER_MARKER_CHANGE, url, str(prefix))
    assert (prefix / INCOMPLETE_MARKER).exists(), os.listdir(prefix)  # the id was never without a claim
    held = Claim.parse((prefix / INCOMPLETE_MARKER).read_bytes())
    assert held is not None and (held.is_gc() or (prefix / INCOMPLETE_MARKER).read_bytes() == dead), held
    assert not list_checkpoints(url, storage)  # the killed save: never committed
    with _plain_manager(url) as manager, pytest.raises(IncompleteCheckpointError):
        manager.load(ckpt)
    report = collect_garbage(url, storage, unowned_after_s=0)
    assert not report.failed, report
    assert not list_checkpoints(url, storage)
    assert not prefix.exists() or not os.listdir(prefix), os.listdir(prefix)
