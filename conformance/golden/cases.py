"""The golden cases: seeded values, their schema, and their load templates.

Values are a pure function of a name (seeded generators), so the expected values
are regenerated, never stored, and compared bit-exact against what was written.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conformance.helpers import layout, spec

GOLDEN_DIR = Path(__file__).resolve().parent
DTENSOR_CASE = "dtensor_2rank"


def seeded(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Deterministic tensor for ``name``: the same bits on every machine and process."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=torch.int64).to(dtype)


def seeded_bytes(name: str, n: int) -> bytes:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return bytes(torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64).tolist())


@dataclass(frozen=True)
class Case:
    """One single-rank golden checkpoint: schema, saved payload, load template, files it must hold."""

    name: str
    clauses: tuple[str, ...]
    items: Callable[[], dict[str, Any]]
    payload: Callable[[], dict[str, Any]]
    template: Callable[[], dict[str, Any]]
    files: tuple[str, ...]


def _model() -> dict[str, Any]:
    return {
        "w": seeded("torch.w", (4, 3)),
        "b": seeded("torch.b", (3,), torch.bfloat16),
        "ids": seeded("torch.ids", (5,), torch.int64),
        "meta": {"name": "golden", "sizes": [4, 3]},
    }


def _zeros_like_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _zeros_like_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_zeros_like_tree(v) for v in value]
    return value


def _st_tree() -> dict[str, Any]:
    return {
        "layer": {"w": seeded("st.w", (3, 2)), "b": seeded("st.b", (2,), torch.float16)},
        "stack": [seeded("st.s0", (2,)), seeded("st.s1", (1, 2), torch.int32)],
    }


CASES: tuple[Case, ...] = (
    Case(
        "torch_default",
        ("TORCH-FILE-1", "LAYOUT-DEFAULT-1"),
        dict,
        lambda: {"model": _model(), "step": 17},
        lambda: {"model": _zeros_like_tree(_model()), "step": 0},
        ("model_0.pt", "step_0.pt"),
    ),
    Case(
        "json",
        ("JSON-CLS-1", "LAYOUT-SUBDIR-1"),
        lambda: {
            "misc_state": spec(requires_copy=False, layout=layout("meta/misc_state_{rank}.json", "JsonSerialization"))
        },
        lambda: {"misc_state": {"step": 17, "cfg": {"lr": 0.5, "name": "x", "betas": [0.9, 0.999]}}},
        lambda: {"misc_state": None},
        ("meta/misc_state_0.json",),
    ),
    Case(
        "raw",
        ("RAW-BYTES-1", "LAYOUT-SUBDIR-1"),
        lambda: {"blob": spec(layout=layout("blobs/blob_{rank}.bin", "RawSerialization"))},
        lambda: {"blob": seeded_bytes("raw.blob", 96)},
        lambda: {"blob": None},
        ("blobs/blob_0.bin",),
    ),
    Case(
        "safetensors",
        ("ST-RENEST-1", "ST-FILE-1", "LAYOUT-SUBDIR-1"),
        lambda: {
            "model": spec(
                layout=layout(
                    "rank_{rank}/model.safetensors", "SafetensorsSerialization", metadata={"format_version": "1"}
                )
            )
        },
        lambda: {"model": _st_tree()},
        lambda: {"model": _zeros_like_tree(_st_tree())},
        ("rank_0/model.safetensors",),
    ),
    Case(
        "torch_subdir",
        ("TORCH-FILE-1", "LAYOUT-SUBDIR-1", "LAYOUT-RANK-1"),
        lambda: {"optimizer": spec(layout=layout("rank_{rank}/nested/optimizer.pt", "TorchSerialization"))},
        lambda: {
            "optimizer": {
                "state": {0: {"exp_avg": seeded("opt.m", (6,))}},
                "param_groups": [{"lr": 0.1, "params": [0]}],
            }
        },
        lambda: {
            "optimizer": {"state": {0: {"exp_avg": torch.zeros(6)}}, "param_groups": [{"lr": 0.0, "params": [0]}]}
        },
        ("rank_0/nested/optimizer.pt",),
    ),
)

# The 2-rank DTensor case: item "model" (default layout) and "st" (safetensors), both with
# DTensorResharder; global values below, saved Shard(0) / Replicate on a 1-D mesh of 2 ranks.
DTENSOR_GLOBALS: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {
    "w": ("golden.w", (5, 3), torch.float32),
    "i": ("golden.i", (7,), torch.int64),
    "v": ("golden.v", (4,), torch.float64),
}
DTENSOR_ST = ("golden.st", (6, 2), torch.float32)


def assert_tree_equal(got: Any, want: Any, where: str = "") -> None:
    """Bit-exact comparison (dtype, shape and bits) with the failing path in the message."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: expected a dict, got {type(got).__name__}"
        for k, v in want.items():
            assert k in got, f"{where}.{k}: missing"
            assert_tree_equal(got[k], v, f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=False)):
            assert_tree_equal(g, w, f"{where}.{i}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"
