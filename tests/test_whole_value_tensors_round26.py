"""A tensor of any kind a sync save writes inside a value taken whole (a deque, a set, an object of the caller's)
is written by an async save too, and loads back the same.

The async save deep-copies such a value and hands it to the writer process through a pipe. A deep copy refuses a
sparse CSR tensor, a nested tensor and a tensor autograd made (a row of an `nn.Parameter`), and the pipe's tensor
reduction loses a quantized tensor's quantizer: each failed the async save (the quantized one in the writer,
after `save()` had returned, saying the value does not pickle), where a sync save, and torch.save, wrote it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointLoaderConfig, SyncCheckpointSaverConfig


def _values(t: torch.Tensor) -> torch.Tensor:
    """What two tensors of one kind must agree on: their values, densified."""
    if t.is_nested:
        return torch.cat([x.flatten() for x in t.unbind()])
    if t.is_quantized:
        return torch.cat([t.dequantize().flatten(), torch.tensor([t.q_scale(), float(t.q_zero_point())])])
    return t.detach().to_dense()


KINDS: dict[str, Callable[[], torch.Tensor]] = {
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.tensor([0.5, -1.0, 2.0]), 0.5, 3, torch.qint8),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)]),
    "parameter_row": lambda: torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))[1],
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_tensor_inside_a_whole_value_is_saved_by_both_modes(tmp_path: Path, kind: str, mode: str) -> None:
    tensor = KINDS[kind]()
    save = SyncCheckpointSaverConfig() if mode == "sync" else AsyncCheckpointSaverConfig()
    config = CheckpointManager.Config(save=save, load=CheckpointLoaderConfig(weights_only=False))
    with CheckpointManager(config) as manager:
        future = manager.save(str(tmp_path / "ck"), {"model": {"w": torch.ones(2), "queue": deque([tensor, 7])}})
        if future is not None:
            future.result(timeout=120)
        loaded = manager.load(str(tmp_path / "ck"))["model"]["queue"]
    assert list(loaded)[1] == 7
    got = loaded[0]
    assert (got.layout, got.is_quantized, got.is_nested, got.dtype) == (
        tensor.layout,
        tensor.is_quantized,
        tensor.is_nested,
        tensor.dtype,
    )
    assert torch.equal(_values(got), _values(tensor))
