"""`import_hf(into=...)` of a shard holding a tensor the index places in another shard, or does not list.

The flat import refused such a directory (which copy is the model's is unknown), as the docs say; the
templated import read the index's copy and never looked at what else the opened shards held, so the same
damaged download was refused without a template and silently imported with one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import INDEX_FILE_NAME, import_hf


def _folder(root: Path, first_shard: dict[str, torch.Tensor]) -> Path:
    """s1 holds `first_shard`; s2 holds b = 7; the index places a in s1 and b in s2."""
    root.mkdir()
    save_file(first_shard, str(root / "s1.safetensors"))
    save_file({"b": torch.full((2,), 7.0)}, str(root / "s2.safetensors"))
    weight_map = {"a": "s1.safetensors", "b": "s2.safetensors"}
    (root / INDEX_FILE_NAME).write_text(json.dumps({"metadata": {"total_size": 16}, "weight_map": weight_map}))
    return root


@pytest.mark.parametrize(
    ("extra", "said"),
    [({"b": torch.full((2,), 5.0)}, "places it in 's2.safetensors'"), ({"c": torch.ones(2)}, "does not list it")],
    ids=["name-in-two-shards", "unlisted-name"],
)
@pytest.mark.parametrize("keys", [("a", "b"), ("a",)], ids=["all", "first-only"])
def test_templated_import_refuses_a_shard_the_index_disagrees_with(
    tmp_path: Path, extra: dict[str, torch.Tensor], said: str, keys: tuple[str, ...]
) -> None:
    folder = _folder(tmp_path / "hf", {"a": torch.ones(2), **extra})
    with pytest.raises(CorruptCheckpointError, match="index and its shards disagree"):
        import_hf(folder)  # the flat import already refused it
    template = {key: torch.zeros(2) for key in keys}
    with pytest.raises(CorruptCheckpointError, match=said) as info:
        import_hf(folder, into=template)
    assert "s1.safetensors" in str(info.value)
    assert all(torch.equal(t, torch.zeros(2)) for t in template.values())  # nothing copied


def test_templated_import_of_an_agreeing_folder_still_fills(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "hf", {"a": torch.ones(2)})
    template = {"a": torch.zeros(2), "b": torch.zeros(2)}
    import_hf(folder, into=template)
    assert torch.equal(template["a"], torch.ones(2)) and torch.equal(template["b"], torch.full((2,), 7.0))
