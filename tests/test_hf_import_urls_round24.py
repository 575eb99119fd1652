"""`import_hf` of a URL: it reads a local directory only, and says so as `export_hf` says it of its output.

Before: the URL went through `Path`, which folded `file:///abs/hf` into the relative path `file:/abs/hf`, and
the import raised `FileNotFoundError: file:/abs/hf has no model.safetensors.index.json ...`: a path nobody
passed, and a "missing index" for an export that is complete.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.hf import export_hf, import_hf


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "step_1"), {"model": {"w": torch.arange(4.0)}})
    export_hf(tmp_path / "step_1", "model", tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize("into", [None, {"w": torch.zeros(4)}])
def test_a_file_url_is_refused_naming_the_local_path_to_pass(exported: Path, into: object) -> None:
    url = f"file://{exported}"
    with pytest.raises(ConfigError) as raised:
        import_hf(url, into)
    said = str(raised.value)
    assert repr(url) in said and repr(str(exported)) in said, said
    assert "file:/" + str(exported).lstrip("/") + " " not in said, said  # not the folded path
    assert torch.equal(import_hf(exported)["w"], torch.arange(4.0))  # the path it names imports


@pytest.mark.parametrize("url", ["s3://bucket/hf", "memory://hf"])
def test_an_object_store_url_is_refused_naming_the_fix(url: str) -> None:
    with pytest.raises(ConfigError) as raised:
        import_hf(url)
    said = str(raised.value)
    assert repr(url) in said and "local directory" in said and "download" in said, said
