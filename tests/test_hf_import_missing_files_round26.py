"""`import_hf` of a directory that names a file which is not there.

An index naming a shard the folder lacks (a download stopped between files), a hub-cache link whose blob was
removed, or a shard deleted after the index was read: each is a damaged or incomplete download, and raised a
bare `FileNotFoundError` (worded "named by the export") that a caller catching `CheckpointError` for a damaged
download never saw. Each is now a `CorruptCheckpointError` naming the file, with nothing imported. A file or the
folder this user may not read is a `PermissionError` naming it and the fix, never "no index" (root ignores
permissions, so those checks run in a child that drops to an unprivileged user).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import torch_checkpointing.hf as hf
from tests.test_unreadable_files_round24 import run_as_nobody
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import INDEX_FILE_NAME, import_hf

FIRST = "model-00001-of-00002.safetensors"
SECOND = "model-00002-of-00002.safetensors"


def _two_shards(folder: Path) -> None:
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / FIRST))
    save_file({"b": torch.full((2,), 2.0)}, str(folder / SECOND))
    index = {"metadata": {"total_size": 16}, "weight_map": {"a": FIRST, "b": SECOND}}
    (folder / INDEX_FILE_NAME).write_text(json.dumps(index))


def _template() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(2), "b": torch.zeros(2)}


def _untouched(template: dict[str, torch.Tensor] | None) -> bool:
    return template is None or all(torch.equal(t, torch.zeros(2)) for t in template.values())


@pytest.mark.parametrize("into", [False, True], ids=["flat", "into"])
def test_a_shard_the_index_names_but_the_folder_lacks(tmp_path: Path, into: bool) -> None:
    _two_shards(tmp_path / "hf")
    (tmp_path / "hf" / SECOND).unlink()
    template = _template() if into else None
    with pytest.raises(CorruptCheckpointError, match=SECOND) as info:
        import_hf(tmp_path / "hf", into=template)
    assert "Download it again" in str(info.value) and "export" not in str(info.value)
    assert _untouched(template)


@pytest.mark.parametrize("dangling", [INDEX_FILE_NAME, SECOND, "model.safetensors"])
def test_a_hub_cache_link_whose_blob_was_removed(tmp_path: Path, dangling: str) -> None:
    """A hub snapshot is links into its blobs: a cleaned-up blob leaves a link to nothing."""
    if dangling == "model.safetensors":
        (tmp_path / "hf").mkdir()
    else:
        _two_shards(tmp_path / "hf")
        (tmp_path / "hf" / dangling).unlink()
    (tmp_path / "hf" / dangling).symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(CorruptCheckpointError, match=dangling):
        import_hf(tmp_path / "hf")


@pytest.mark.parametrize("into", [False, True], ids=["flat", "into"])
def test_a_shard_deleted_after_the_index_was_read(tmp_path: Path, into: bool, monkeypatch: Any) -> None:
    """A real deletion at the moment between reading the index and opening the shard."""
    _two_shards(tmp_path / "hf")
    read_index = hf._hf_files

    def then_delete(directory: Path) -> dict[str, str]:
        files = read_index(directory)
        os.unlink(directory / SECOND)
        return files

    monkeypatch.setattr(hf, "_hf_files", then_delete)
    template = _template() if into else None
    with pytest.raises(CorruptCheckpointError, match=SECOND):
        import_hf(tmp_path / "hf", into=template)
    assert _untouched(template)


CHILD = """
import json, os, sys, torch
from torch_checkpointing.hf import import_hf
import_hf(sys.argv[2])  # imports what the import imports, while root can
os.setgid(%(nobody)d)
os.setuid(%(nobody)d)
out = {}
for into in (None, {"a": torch.zeros(2), "b": torch.zeros(2)}):
    try:
        import_hf(sys.argv[1], into=into)
        out[str(into is None)] = {"kind": "imported", "text": ""}
    except Exception as exc:
        out[str(into is None)] = {"kind": type(exc).__name__, "text": str(exc)}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="drops to another user: needs root")
@pytest.mark.parametrize("closed", [SECOND, INDEX_FILE_NAME, "folder", "unlistable folder"])
def test_a_file_this_user_may_not_read_is_said_so_naming_it(closed: str) -> None:
    """Before: the OS's bare "[Errno 13] Permission denied: '...'", which named no fix."""
    base = Path(tempfile.mkdtemp(prefix="round26-hf-unreadable-"))
    try:
        _two_shards(base / "hf")
        _two_shards(base / "warm")
        for p in [base, *base.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        target = base / "hf" if "folder" in closed else base / "hf" / closed
        os.chmod(target, {"folder": 0o700, "unlistable folder": 0o711}.get(closed, 0o600))
        if closed == "unlistable folder":  # searchable but not listable: the single-file layout is looked for
            (base / "hf" / INDEX_FILE_NAME).unlink()
            (base / "hf" / FIRST).unlink()
        result = run_as_nobody(CHILD, str(base / "hf"), str(base / "warm"))
    finally:
        shutil.rmtree(base)
    for outcome in result.values():
        assert outcome["kind"] == "PermissionError", outcome
        assert str(target) in outcome["text"] and "run as its owner" in outcome["text"], outcome
        assert "damaged" not in outcome["text"].lower(), outcome


@pytest.mark.parametrize("under", ["", "sub"], ids=["the-file", "under-the-file"])
def test_a_path_that_is_no_folder_is_named_so(tmp_path: Path, under: str) -> None:
    """The file `model.safetensors` passed for the folder holding it (or a path under a file). Defect: the check
    for an index that this round made raise said the OS's bare "[Errno 20] Not a directory:
    '.../model.safetensors/model.safetensors.index.json'" (a NotADirectoryError, naming a path nobody passed);
    before it, a FileNotFoundError. Now a NotADirectoryError saying the path given is no folder, and which to
    pass."""
    single = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2)}, str(single))
    given = single / under if under else single
    with pytest.raises(NotADirectoryError) as caught:
        import_hf(given)
    message = str(caught.value)
    assert "not a folder" in message and str(given) in message and "pass the folder" in message, message
    assert INDEX_FILE_NAME not in message.split(":", 1)[0], message  # no made-up path comes first
    assert "Errno" not in message, message
