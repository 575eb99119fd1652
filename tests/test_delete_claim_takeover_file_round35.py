"""On `file://`, a delete's claim goes up in place of a dead one only while that dead one is still there.

A delete of a committed checkpoint puts its own live claim up in place of a dead `.incomplete` beside the
manifest. On `file://` it did so with a plain rename, outside the directory's lock that a save's take-over of
the same dead claim holds (`replace_object`): a save that took the claim over after the delete judged it dead
lost it to the rename, and the delete then removed the id under the save, which held it too.

Real processes on real files: the delete runs in a child, held right after it read the dead claim.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.test_objstore_round22 import _plain_manager
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.commit import Claim
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.names import this_host

pytest.importorskip("fsspec")

# rmdir of the checkpoint, held after its claim's put-up read the marker (the put-up drops the marker's cached
# listing, then reads it): it touches `held`, then waits for `release`. Prints REMOVED, or REFUSED and the error.
_HELD_DELETE = r"""
import os, sys, time
from pathlib import Path
from fsspec.implementations.local import LocalFileSystem
from torch_checkpointing import FsspecStorageConfig

url, ckpt, marker, flags = sys.argv[1], sys.argv[2], os.path.abspath(sys.argv[3]), Path(sys.argv[4])
seen = {"put up": False}
real_invalidate, real_cat = LocalFileSystem.invalidate_cache, LocalFileSystem.cat_file

def is_marker(fs, path):
    return path is not None and os.path.abspath(fs._strip_protocol(path)) == marker

def invalidate_cache(self, path=None):
    seen["put up"] = seen["put up"] or is_marker(self, path)
    return real_invalidate(self, path)

def cat_file(self, path, *args, **kwargs):
    out = real_cat(self, path, *args, **kwargs)
    if seen["put up"] and is_marker(self, path):
        seen["put up"] = False
        (flags / "held").touch()
        while not (flags / "release").exists():
            time.sleep(0.02)
    return out

LocalFileSystem.invalidate_cache, LocalFileSystem.cat_file = invalidate_cache, cat_file
try:
    FsspecStorageConfig(url=url).create_storage().rmdir(Path(ckpt))
    print("REMOVED")
except Exception as exc:
    print("REFUSED", exc)
"""


def test_a_save_taking_over_the_dead_claim_meanwhile_keeps_it_and_the_delete_is_refused(tmp_path: Path) -> None:
    """Defect: the child printed REMOVED: the save's claim was replaced by the delete's, then the id's files and
    the marker went, while the save held the id."""
    url = f"file://{tmp_path}/run"
    with _plain_manager(url) as manager:
        manager.save("step_1", {"w": 1})
    prefix = tmp_path / "run" / "step_1"
    marker = prefix / INCOMPLETE_MARKER
    marker.write_bytes(b"")  # a dead claim beside the manifest (an earlier version's, a killed delete's)
    flags = tmp_path / "flags"
    flags.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", _HELD_DELETE, url, "step_1", str(marker), str(flags)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120  # only to stop a hang: the child is there in about a second
        while not (flags / "held").exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (flags / "held").exists(), child.communicate(timeout=60)[0].decode(errors="replace")
        storage = FsspecStorageConfig(url=url).create_storage()
        found = storage.read_object(Path(f"step_1/{INCOMPLETE_MARKER}"))
        assert found is not None and found[0] == b""
        save = Claim("a-save-taking-over", "", this_host(), os.getpid(), time.time(), took_over=True).to_bytes()
        assert storage.replace_object(Path(f"step_1/{INCOMPLETE_MARKER}"), save, found[1])
    finally:
        (flags / "release").touch()
        output = child.communicate(timeout=120)[0].decode(errors="replace")
    assert "REFUSED" in output and "held by another save" in output, output
    assert marker.read_bytes() == save
    assert (prefix / MANIFEST_FILE_NAME).exists()


def test_on_memory_a_take_over_meanwhile_keeps_the_claim_and_the_delete_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same on `memory://` (one process, two threads): the delete's replace was a plain write there, outside
    the lock the take-over holds. Defect: the delete returned, and the id was gone with the save's claim."""
    from fsspec.implementations.memory import MemoryFileSystem

    url = f"memory://r35-{uuid.uuid4().hex[:8]}/run"
    with _plain_manager(url) as manager:
        manager.save("step_1", {"w": 1})
    storage = FsspecStorageConfig(url=url).create_storage()
    marker = Path(f"step_1/{INCOMPLETE_MARKER}")
    assert storage.create_object(marker, b"")  # a dead claim beside the manifest
    name = storage.remap_path(marker).removeprefix("memory://")
    held, release, seen = threading.Event(), threading.Event(), {"put up": False}
    real_invalidate, real_cat = MemoryFileSystem.invalidate_cache, MemoryFileSystem.cat_file

    def is_marker(fs: MemoryFileSystem, path: object) -> bool:
        return isinstance(path, str) and fs._strip_protocol(path) == fs._strip_protocol(name)

    def invalidate_cache(self: MemoryFileSystem, path: str | None = None) -> None:
        seen["put up"] = seen["put up"] or is_marker(self, path)
        real_invalidate(self, path)

    def cat_file(self: MemoryFileSystem, path: str, *args: object, **kwargs: object) -> bytes:
        out = bytes(real_cat(self, path, *args, **kwargs))
        if seen["put up"] and is_marker(self, path) and threading.current_thread() is not threading.main_thread():
            seen["put up"] = False
            held.set()
            release.wait(120)  # only to stop a hang
        return out

    monkeypatch.setattr(MemoryFileSystem, "invalidate_cache", invalidate_cache)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    outcome: list[BaseException | None] = []

    def delete() -> None:
        try:
            storage.rmdir(Path("step_1"))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    deleter = threading.Thread(target=delete)
    deleter.start()
    try:
        assert held.wait(120)
        found = storage.read_object(marker)
        assert found is not None and found[0] == b""
        save = Claim("a-save-taking-over", "", this_host(), os.getpid(), time.time(), took_over=True).to_bytes()
        assert storage.replace_object(marker, save, found[1])
    finally:
        release.set()
        deleter.join(120)
    assert outcome and outcome[0] is not None and "held by another save" in str(outcome[0]), outcome
    kept = storage.read_object(marker)
    assert kept is not None and kept[0] == save
    assert storage.exists(Path(f"step_1/{MANIFEST_FILE_NAME}"))
