"""`import_hf` of a directory that names a file which is not there.

An index naming a shard the folder lacks (a download stopped between files), a hub-cache link whose blob was
removed, or a shard deleted after the index was read: each is a damaged or incomplete download, and raised a
bare `FileNotFoundError` (worded "named by the export") that a caller catching `CheckpointError` for a damaged
download never saw. Each is now a `CorruptCheckpointError` naming the file, with nothing imported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import torch_checkpointing.hf as hf
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
