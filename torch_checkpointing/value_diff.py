"""What `torch-checkpointing diff` says of two leaves: nothing when they hold the same value, else what differs.

"The same value" is what a restore would give back: NaN equals NaN (a checkpoint compared with a copy of
itself is identical), equal infinities are equal, and integers are compared as integers (an int64 seen
through float64 merged 2**53 and 2**53 + 1). Tensors are compared in chunks of their elements, widened to
float64 (complex128) per chunk only, so a large item does not double in memory; sparse tensors are compared
by their structure, then their values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from torch_checkpointing.traversal import dotted_key, iter_leaves, local_tensor

__all__ = ["compare", "named_leaves"]

_CHUNK = 1 << 22  # elements widened at once
_INT64_MIN = -(1 << 63)


def named_leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf under its dotted name; where two paths share one dotted name (a key holding a '.', an int
    key beside an equal str key) both are named by their full path instead, so neither hides the other."""
    found: dict[str, list[tuple[tuple[Any, ...], Any]]] = {}
    for path, leaf in iter_leaves(value):
        name = ".".join(part for part in (prefix, dotted_key(path)) if part)
        found.setdefault(name, []).append((path, local_tensor(leaf)))
    out: dict[str, Any] = {}
    for name, entries in found.items():
        if len(entries) == 1:
            out[name] = entries[0][1]
            continue
        for path, leaf in entries:
            out[f"{name} {list(path)!r}"] = leaf
    return out


def compare(a: Any, b: Any) -> str | None:
    """None when `a` and `b` hold the same value; else a short account of the difference."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _compare_tensors(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return f"{type(a).__name__} vs {type(b).__name__}"
    if type(a) is type(b) and _same_plain(a, b):
        return None
    return f"{_short(a)} vs {_short(b)}"


def _same_plain(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # an object whose == is elementwise or refuses (a numpy array): compare what it shows
        return repr(a) == repr(b)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _compare_tensors(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if a.layout != b.layout:
        return f"layout {a.layout} vs {b.layout}"
    if a.layout != torch.strided:
        return _compare_sparse(a, b)
    if a.is_quantized:
        return None if torch.equal(a, b) else "quantized values or quantization parameters differ"
    return _compare_dense(a.reshape(-1), b.reshape(-1))


def _sparse_parts(t: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(index tensors, values) of a sparse tensor, COO coalesced first so equal tensors have equal parts."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        return [t.indices()], t.values()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices()], t.values()
    return [t.ccol_indices(), t.row_indices()], t.values()


def _compare_sparse(a: torch.Tensor, b: torch.Tensor) -> str | None:
    (index_a, values_a), (index_b, values_b) = _sparse_parts(a), _sparse_parts(b)
    if any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(index_a, index_b, strict=True)):
        return f"{a.layout} sparsity pattern differs ({values_a.shape[0]} vs {values_b.shape[0]} stored values)"
    detail = _compare_dense(values_a.reshape(-1), values_b.reshape(-1))
    return None if detail is None else f"stored values: {detail}"


def _chunks(a: torch.Tensor, b: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, a.numel(), _CHUNK):
        yield a[start : start + _CHUNK], b[start : start + _CHUNK]


def _compare_dense(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.dtype.is_floating_point or a.is_complex():
        return _compare_floats(a, b)
    if torch.equal(a, b):
        return None
    if a.dtype in (torch.bool, torch.uint64):
        return _compare_widened(a, b)
    return _compare_ints(a, b)


def _compare_floats(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Max |a - b| over the elements that differ; a NaN against a number is counted apart (its difference has
    no size)."""
    wide = torch.complex128 if a.is_complex() else torch.float64
    largest, nan_against_number, differing = 0.0, 0, 0
    for x, y in _chunks(a, b):
        x, y = x.to(wide), y.to(wide)
        differs = ~((x == y) | (x.isnan() & y.isnan()))
        count = int(differs.sum())
        if not count:
            continue
        differing += count
        delta = (x[differs] - y[differs]).abs().to(torch.float64)
        nan = delta.isnan()
        nan_against_number += int(nan.sum())
        if bool((~nan).any()):
            largest = max(largest, float(delta[~nan].max()))
    if not differing:
        return None
    parts = []
    if differing > nan_against_number:
        parts.append(f"max abs diff {largest:.6g}")
    if nan_against_number:
        parts.append(f"{nan_against_number} NaN where the other holds a number")
    return ", ".join(parts)


def _compare_ints(a: torch.Tensor, b: torch.Tensor) -> str:
    """Exact: int64 arithmetic, with the rare difference past int64 (|a - b| >= 2**63) taken in float64."""
    largest: int | float = 0
    for x, y in _chunks(a, b):
        x, y = x.to(torch.int64), y.to(torch.int64)
        d = x - y
        wrapped = ((x ^ y) & (x ^ d)) < 0  # the subtraction overflowed
        if bool(wrapped.any()) or bool((d == _INT64_MIN).any()):
            largest = max(largest, float((x.to(torch.float64) - y.to(torch.float64)).abs().max()))
        else:
            largest = max(largest, int(d.abs().max()))
    return f"max abs diff {largest:.6g}" if isinstance(largest, float) else f"max abs diff {largest}"


def _compare_widened(a: torch.Tensor, b: torch.Tensor) -> str:
    largest = 0.0
    for x, y in _chunks(a, b):
        largest = max(largest, float((x.to(torch.float64) - y.to(torch.float64)).abs().max()))
    return f"max abs diff {largest:.6g}"
