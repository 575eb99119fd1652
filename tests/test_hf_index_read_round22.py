"""An HF directory's `model.safetensors.index.json` is read for what it holds, bounded.

Before: `_regular_bytes` asked for `read(limit + 1)`, which allocates its argument up front: every import of a
sharded HF directory took 64 MiB for an index of a few hundred bytes.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import INDEX_FILE_NAME, import_hf

SMALL_PEAK_BYTES = 4 << 20  # far below the index limit of 64 MiB


def _sharded_hf_directory(root: Path) -> Path:
    save_file({"a": torch.arange(4.0)}, str(root / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2)}, str(root / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {"total_size": 24},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (root / INDEX_FILE_NAME).write_text(json.dumps(index))
    return root


def test_an_index_read_allocates_what_the_index_holds_not_its_limit(tmp_path: Path) -> None:
    """Failed before: 67,114,222 bytes traced for a 130-byte index."""
    directory = _sharded_hf_directory(tmp_path)
    tracemalloc.start()
    try:
        restored = import_hf(directory)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(restored["a"], torch.arange(4.0)) and torch.equal(restored["b"], torch.ones(2))
    assert peak < SMALL_PEAK_BYTES, (
        f"importing with a {(directory / INDEX_FILE_NAME).stat().st_size}-byte index took {peak}"
    )


def test_an_index_past_its_limit_is_refused_naming_it(tmp_path: Path) -> None:
    directory = _sharded_hf_directory(tmp_path)
    with open(directory / INDEX_FILE_NAME, "r+b") as f:
        f.truncate(65 << 20)  # sparse: no disk taken
    with pytest.raises(CorruptCheckpointError, match=INDEX_FILE_NAME.replace(".", r"\.")):
        import_hf(directory)
