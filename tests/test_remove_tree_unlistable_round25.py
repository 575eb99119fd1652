"""Round 25: removing a checkpoint directory that this user may change but not list stripped its marks.

`remove_tree_marks_last` removes everything below a directory, then its manifest and `.incomplete` marker, then
the directory: a removal that stops midway leaves a directory gc still knows as ours. `os.walk` drops a directory
it cannot list in silence, so one with write and search permission but no read permission looked empty: the
manifest and marker went, the rmdir failed on the files still there, and what was left was an anonymous folder
that gc never collects. A listing that fails now raises before anything is removed. The failure is a real one:
the removal runs as an unprivileged user in a child.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_unreadable_files_round24 import NOBODY, run_as_nobody
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME

CHILD = """
import json, os, sys
from pathlib import Path
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
os.setgid(%(nobody)d)
os.setuid(%(nobody)d)
try:
    LocalFileSystemStorage(LocalFileSystemStorageConfig()).rmdir(Path(sys.argv[1]))
    said = None
except OSError as exc:
    said = str(exc)
print("RESULT " + json.dumps(said))
"""


@pytest.fixture
def closed_checkpoint() -> Iterator[Path]:
    """A checkpoint-like directory an unprivileged user owns, with write and search but no read permission."""
    base = Path(tempfile.mkdtemp(prefix="round25-rmtree-unlistable-"))
    try:
        directory = base / ".step_3.trash-1-0123abcd-0123abcd"
        directory.mkdir()
        for name in (MANIFEST_FILE_NAME, INCOMPLETE_MARKER, "model_0.pt"):
            (directory / name).write_bytes(b"{}")
            os.chown(directory / name, NOBODY, NOBODY)
        os.chmod(base, 0o777)
        os.chown(directory, NOBODY, NOBODY)
        os.chmod(directory, 0o300)
        yield directory
    finally:
        os.chmod(base / ".step_3.trash-1-0123abcd-0123abcd", 0o700)
        shutil.rmtree(base)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="drops to another user: needs root")
def test_a_directory_that_cannot_be_listed_keeps_its_marks(closed_checkpoint: Path) -> None:
    said = run_as_nobody(CHILD, str(closed_checkpoint))
    left = sorted(os.listdir(closed_checkpoint))  # as root
    assert left == sorted([INCOMPLETE_MARKER, MANIFEST_FILE_NAME, "model_0.pt"]), left
    assert said is not None and "Permission denied" in said, said
