"""`import_hf` of a path that is not one model's folder says which case it is, naming the path and the fix.

Before, a missing folder, an empty folder, and a folder holding two unrelated `*.safetensors` files all raised
one bare `FileNotFoundError` ("has no model.safetensors.index.json and not exactly one *.safetensors file"),
which named neither the files nor what to do, and a file given for the folder raised the OS's
`NotADirectoryError` naming the index inside it. Now: a missing folder or none in it is the caller's error
(`FileNotFoundError` naming the path and what to pass, never a `CheckpointError`: nothing is damaged), a file is
`NotADirectoryError`, several files without an index are a `ConfigError` naming them (which one is the model is
unknown), and several shards of one series without their index stay an incomplete download.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torch_checkpointing.errors import CheckpointError, ConfigError, CorruptCheckpointError
from torch_checkpointing.hf import import_hf

_FIX = "pass the folder an HF download or export_hf wrote"


def test_a_missing_folder_is_the_callers_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as info:
        import_hf(missing)
    assert str(missing) in str(info.value) and "no such directory" in str(info.value), info.value
    assert _FIX in str(info.value), info.value


def test_an_empty_folder_says_it_holds_no_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors.index.json nor") as info:
        import_hf(tmp_path)
    assert str(tmp_path) in str(info.value) and _FIX in str(info.value), info.value


def test_a_file_for_the_folder_names_what_to_pass(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(NotADirectoryError, match="is a file, not a folder") as info:
        import_hf(tmp_path / "model.safetensors")
    assert _FIX in str(info.value), info.value


def test_two_unrelated_files_are_named_and_none_is_imported(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    save_file({"lora": torch.ones(2)}, str(tmp_path / "adapter_model.safetensors"))
    template = {"a": torch.zeros(2)}
    with pytest.raises(ConfigError) as info:
        import_hf(tmp_path, into=template)
    message = str(info.value)
    assert "adapter_model.safetensors" in message and "model.safetensors" in message and "Move" in message, message
    assert not isinstance(info.value, CheckpointError)
    assert torch.equal(template["a"], torch.zeros(2))


def test_shards_of_a_series_without_their_index_are_an_incomplete_download(tmp_path: Path) -> None:
    """Pins that two shards of one series are no "two unrelated files": their index is what is missing."""
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="incomplete"):
        import_hf(tmp_path)


def test_one_file_still_imports(tmp_path: Path) -> None:
    save_file({"a": torch.full((2,), 3.0)}, str(tmp_path / "weights.safetensors"))
    assert import_hf(tmp_path)["a"].tolist() == [3.0, 3.0]
