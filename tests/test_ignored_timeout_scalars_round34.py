"""`CheckpointWriterConfig.checkpoint_write_barrier_timeout_sec`, accepted for old code and ignored, keeps a
numpy or 0-d tensor number as the plain int or float it stands for, as every other timeout of the configs does.

It was kept as given: a `torch.tensor(30)` (a CUDA one too) rode in the config pickled to every writer process,
and `np.int64(30)` stayed an int64, where docs/api_differences.md (row 27) promises the configs' timeouts keep
the plain number. A value that is no number is still accepted (ignored, with its FutureWarning), as before.
"""

from __future__ import annotations

import fractions
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing.config import CheckpointWriterConfig


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        (np.int64(30), 30),
        (torch.tensor(30), 30),
        (np.float32(2.5), 2.5),
        (torch.tensor(2.5), 2.5),
        (fractions.Fraction(5, 2), 2.5),
    ],
    ids=["np-int64", "tensor-int", "np-float32", "tensor-float", "fraction"],
)
def test_the_ignored_barrier_timeout_keeps_the_plain_number(given: Any, kept: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        value = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=given).checkpoint_write_barrier_timeout_sec
    assert type(value) is type(kept)
    assert value == kept


def test_the_ignored_barrier_timeout_still_warns_and_is_still_taken_as_given() -> None:
    with pytest.warns(FutureWarning, match="checkpoint_write_barrier_timeout_sec"):
        config = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec="30")  # type: ignore[arg-type]
    assert config.checkpoint_write_barrier_timeout_sec == "30"
