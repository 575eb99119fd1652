"""What `import_hf` copies into memory (round 24): a flat import returns tensors that must not be views of the
shards, so it reads each shard from one copy in memory; an import into a template copies into the caller's
tensors, so it copies no shard whole (as a load into templates copies no file).

Before: every shard of an import into a template was copied whole into memory, all of them at once (the
check phase opens them all before the first fill): the model's size again in RAM, and on every rank of a
DTensor template, which reads only its own part. A lone shard was also copied once more just to list its names.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from torch_checkpointing import hf


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every shard copied into memory (a spy on the copy, not a timing)."""
    made: list[int] = []
    real: Callable[..., Any] = hf.private_copy

    def spy(fd: int, size: int, on_short: Any) -> Any:
        made.append(size)
        return real(fd, size, on_short)

    monkeypatch.setattr(hf, "private_copy", spy)
    return made


def _export(root: Path, shards: int) -> dict[str, torch.Tensor]:
    saved = {f"layer{i}.w": torch.full((1024,), float(i)) for i in range(shards)}
    if shards == 1:
        save_file(saved, str(root / "model.safetensors"))
        return saved
    weight_map = {}
    for i, (name, tensor) in enumerate(saved.items()):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: tensor}, str(root / shard))
        weight_map[name] = shard
    import json

    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return saved


@pytest.mark.parametrize("shards", [1, 3])
def test_an_import_into_a_template_copies_no_shard(tmp_path: Path, copies: list[int], shards: int) -> None:
    saved = _export(tmp_path, shards)
    template = {name: torch.zeros(1024) for name in saved}
    hf.import_hf(tmp_path, into=template)
    assert all(torch.equal(template[name], saved[name]) for name in saved)
    assert copies == [], "an import into a template copied shards whole into memory"


@pytest.mark.parametrize("shards", [1, 3])
def test_a_flat_import_copies_each_shard_once(tmp_path: Path, copies: list[int], shards: int) -> None:
    saved = _export(tmp_path, shards)
    out = hf.import_hf(tmp_path)
    assert set(out) == set(saved) and all(torch.equal(out[name], saved[name]) for name in saved)
    assert len(copies) == shards, copies
