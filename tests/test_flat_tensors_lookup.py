"""`FlatTensors` (what `cli diff` and the HF export read a source file through) looks keys up in a set.

Its membership test scanned the file's key list, so describing every tensor of a file was quadratic: 11 s for
a file of 20k tensors, most of a 10k-tensor export's time. The check counts comparisons, not seconds.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from torch_checkpointing.source_reader import FlatTensors, SourceFile, SourceTensor


class _CountingKeys(list[str]):
    scans = 0

    def __contains__(self, key: object) -> bool:
        type(self).scans += 1
        return super().__contains__(key)


class _ManyTensors(SourceFile):
    def __init__(self, n: int) -> None:
        self._names = _CountingKeys(f"layer{i}.weight" for i in range(n))

    def tensor(self, path: Any) -> SourceTensor | None:
        return SimpleNamespace(shape=(2, 3), dtype=torch.bfloat16)  # type: ignore[return-value]

    def keys(self) -> list[str]:
        return self._names


def test_describing_every_tensor_never_scans_the_key_list() -> None:
    _CountingKeys.scans = 0
    flat = FlatTensors(_ManyTensors(2000))
    assert [flat.describe(k) for k in flat] == [((2, 3), torch.bfloat16)] * 2000
    assert _CountingKeys.scans == 0
    with pytest.raises(KeyError):
        flat.describe("not.there")
    assert list(flat) == [f"layer{i}.weight" for i in range(2000)]  # the file's order is kept
