"""An error passes as a shortage already named only when its errno says so, never on its words alone.

`raise_if_short_of_resources` let through, as a shortage "named already", any `OSError` whose text held "the
checkpoint was not found damaged", whatever its errno: an I/O error of a storage plugin that words its failures
so, or a file whose name holds those words (the name is in an `OSError`'s text), came out of the decoders' and the
opens' handlers bare, as if the process were short of descriptors, instead of as what it is. Now only EMFILE and
ENFILE pass as named; ENOMEM is always a `MemoryError`.

The same for torch's `RuntimeError`s, which carry no errno attribute: its words for a shortage ("Cannot allocate
memory (12)", "Too many open files (24)") were matched anywhere in the message, and a crafted file whose record name
held them was told as a shortage ("do not delete it"). Now they must end the message, errno included, as torch's
own do.
"""

from __future__ import annotations

import errno
import io
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from tests.test_crafted_round9 import _forge
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import (
    CorruptCheckpointError,
    UndecodableFileError,
    raise_if_short_of_resources,
    undecodable,
)

_WORDS = "the checkpoint was not found damaged"


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.EIO, f"Input/output error; {_WORDS}"),
        OSError(f"a plugin's failure; {_WORDS}"),  # no errno at all
        FileNotFoundError(errno.ENOENT, "No such file or directory", f"/ck/{_WORDS}.pt"),
        PermissionError(errno.EACCES, "Permission denied", f"/ck/{_WORDS}.pt"),
    ],
    ids=["EIO", "no-errno", "ENOENT-name", "EACCES-name"],
)
def test_words_without_a_shortage_errno_are_no_shortage(exc: OSError) -> None:
    """Defect: each was raised back unchanged, "named already", by `raise_if_short_of_resources`, and
    `undecodable` raised it instead of returning the file's error."""
    raise_if_short_of_resources(exc, "/ck/model_0.pt", "item 'model'")  # returns: no shortage
    assert isinstance(undecodable("/ck/model_0.pt", "item 'model'", exc), UndecodableFileError)


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
def test_a_named_descriptor_shortage_still_passes_unchanged(code: int) -> None:
    named = OSError(code, f"Out of file descriptors reading /ck/model_0.pt for item 'model'; {_WORDS}")
    with pytest.raises(OSError) as caught:
        raise_if_short_of_resources(named, "/ck/other.pt", "another step")
    assert caught.value is named


def test_a_named_enomem_is_a_memory_error() -> None:
    with pytest.raises(MemoryError, match="/ck/model_0.pt"):
        raise_if_short_of_resources(OSError(errno.ENOMEM, f"mmap; {_WORDS}"), "/ck/model_0.pt", "item 'model'")


def _crafted_record_name(root: Path, words: str) -> None:
    """Rename the storage record of the checkpoint's tensor, in its pickle only, to `words` (torch then fails
    "locating file data/<words>"), and forge the manifest to match: an attacker controls both."""
    path = root / "model_0.pt"
    with zipfile.ZipFile(path) as old:
        entries = {name: old.read(name) for name in old.namelist()}
    pkl = next(name for name in entries if name.endswith("/data.pkl"))
    key = b"X\x01\x00\x00\x000"  # BINUNICODE '0': the first storage's record name
    assert key in entries[pkl]
    entries[pkl] = entries[pkl].replace(key, b"X" + struct.pack("<I", len(words)) + words.encode())
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as new:
        for name, data in entries.items():
            new.writestr(name, data)
    path.write_bytes(out.getvalue())
    _forge(root, "model_0.pt")


@pytest.mark.parametrize("words", ["Cannot allocate memory (12)", "Too many open files (24)"])
def test_a_crafted_file_wording_a_shortage_is_damage(tmp_path: Path, words: str) -> None:
    """Defect: the load raised `MemoryError: Out of memory reading .../model_0.pt ... (RuntimeError:
    PytorchStreamReader failed locating file data/Cannot allocate memory (12): file not found ...); the checkpoint
    was not found damaged (do not delete it)` (and an `OSError` [Errno 24] for the other words): torch's words
    were matched anywhere in its message, so a crafted file passed itself off as this process's shortage."""
    root = tmp_path / "ck"
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig())
    with CheckpointManager(config) as manager:
        manager.save(str(root), {"model": {"w": torch.ones(3)}})
        _crafted_record_name(root, words)
        with pytest.raises(CorruptCheckpointError, match="model_0.pt"):
            manager.load(str(root))
