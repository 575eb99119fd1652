"""`import_hf` of a directory whose shard files announce a series the index (or the folder) does not complete.

HF shard names say which of how many they are (`model-00002-of-00003.safetensors`) and every shard holds at
least one tensor, so an index naming fewer of its series than the names announce, or no tensor at all, is a
damaged or hand-edited index: before, the tensors of the shards it left out were silently missing from the
result. A folder without an index whose one shard is `k-of-N` with N > 1 is a download that has not finished
(the index and the other shards still to come): before, that one shard came back as the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import INDEX_FILE_NAME, import_hf

FIRST = "model-00001-of-00003.safetensors"
SECOND = "model-00002-of-00003.safetensors"
THIRD = "model-00003-of-00003.safetensors"


def _three_shards(folder: Path) -> dict[str, str]:
    """Three shards of one tensor each; the full weight map."""
    folder.mkdir()
    weight_map = {}
    for k, shard in enumerate((FIRST, SECOND, THIRD)):
        save_file({f"w{k}": torch.full((2,), float(k))}, str(folder / shard))
        weight_map[f"w{k}"] = shard
    return weight_map


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / INDEX_FILE_NAME).write_text(json.dumps({"metadata": {"total_size": 24}, "weight_map": weight_map}))


def test_full_index_still_imports(tmp_path: Path) -> None:
    weight_map = _three_shards(tmp_path / "hf")
    _write_index(tmp_path / "hf", weight_map)
    got = import_hf(tmp_path / "hf")
    assert sorted(got) == ["w0", "w1", "w2"] and torch.equal(got["w2"], torch.full((2,), 2.0))


@pytest.mark.parametrize("into", [False, True], ids=["flat", "into"])
def test_index_leaving_out_a_shard_of_its_series_is_refused(tmp_path: Path, into: bool) -> None:
    weight_map = _three_shards(tmp_path / "hf")
    del weight_map["w1"]  # the index lost the entries of the second shard
    _write_index(tmp_path / "hf", weight_map)
    template = {"w0": torch.zeros(2), "w2": torch.zeros(2)} if into else None
    with pytest.raises(CorruptCheckpointError, match=r"00002-of-00003") as info:
        import_hf(tmp_path / "hf", into=template)
    assert INDEX_FILE_NAME in str(info.value)
    if template is not None:  # refused before anything was copied
        assert all(torch.equal(t, torch.zeros(2)) for t in template.values())


def test_index_naming_no_tensor_is_refused(tmp_path: Path) -> None:
    _three_shards(tmp_path / "hf")
    _write_index(tmp_path / "hf", {})
    with pytest.raises(CorruptCheckpointError, match="no tensor"):
        import_hf(tmp_path / "hf")


def test_lone_shard_of_a_series_without_index_is_refused(tmp_path: Path) -> None:
    """A download with only its first shard there: not the whole model."""
    _three_shards(tmp_path / "hf")
    (tmp_path / "hf" / SECOND).unlink()
    (tmp_path / "hf" / THIRD).unlink()
    with pytest.raises(CorruptCheckpointError, match=INDEX_FILE_NAME.replace(".", r"\.")):
        import_hf(tmp_path / "hf")


def test_lone_single_file_and_one_of_one_still_import(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    save_file({"x": torch.ones(3)}, str(tmp_path / "a" / "model.safetensors"))
    assert torch.equal(import_hf(tmp_path / "a")["x"], torch.ones(3))
    (tmp_path / "b").mkdir()
    save_file({"x": torch.ones(3)}, str(tmp_path / "b" / "model-00001-of-00001.safetensors"))
    assert torch.equal(import_hf(tmp_path / "b")["x"], torch.ones(3))


def test_index_beside_a_single_model_file_is_refused(tmp_path: Path) -> None:
    """`model.safetensors` beside an index: transformers reads the single file first (and never the index),
    import_hf read the index: the two returned different weights from one folder. Which is the model is
    unknown, so the import refuses naming both."""
    weight_map = _three_shards(tmp_path / "hf")
    _write_index(tmp_path / "hf", weight_map)
    save_file({"w0": torch.full((2,), 9.0)}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors\b.*" + INDEX_FILE_NAME.replace(".", r"\.")):
        import_hf(tmp_path / "hf")
