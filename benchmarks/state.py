"""Synthetic checkpoint state: a model of mixed float32/bf16 tensors plus an
AdamW-style optimizer state, deterministic from a seed so that separate
measurement processes regenerate the same bytes."""

from __future__ import annotations

from typing import Any

import torch

# Relative weight-matrix sizes: mixes a few large tensors with many small ones,
# the shape of a real transformer state (embeddings, projections, norms).
_LAYER_WEIGHTS = (16, 1, 4, 2, 8, 1, 1, 3, 6, 2, 1, 12, 1, 4, 2, 1)
_COLS = 256


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """Every tensor leaf of a nested dict/list, in a stable order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in tree for t in tensors_of(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_of(v)]
    return []


def nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(tree))


def _fill(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen)
    return t.to(dtype=dtype, device=device)


def make_state(total_bytes: int, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """A {"model", "optimizer"} payload of about ``total_bytes`` bytes.

    Model weights are bf16 (mixed-precision training), biases and norms float32;
    the optimizer holds float32 exp_avg/exp_avg_sq per parameter plus a step
    counter, as torch.optim.AdamW.state_dict() does. 10 bytes per weight element.
    """
    gen = torch.Generator().manual_seed(seed)
    scale = sum(_LAYER_WEIGHTS)
    model: dict[str, torch.Tensor] = {}
    for i, w in enumerate(_LAYER_WEIGHTS):
        elems = max(_COLS, int(total_bytes * w / scale / 10))
        rows = max(1, elems // _COLS)
        model[f"layer{i}.weight"] = _fill((rows, _COLS), torch.bfloat16, gen, device)
        model[f"layer{i}.bias"] = _fill((rows,), torch.float32, gen, device)
        model[f"layer{i}.norm"] = _fill((_COLS,), torch.float32, gen, device)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for pid, p in enumerate(model.values()):
        state[pid] = {
            "step": torch.tensor(float(pid + 1)),
            "exp_avg": _fill(tuple(p.shape), torch.float32, gen, device),
            "exp_avg_sq": _fill(tuple(p.shape), torch.float32, gen, device).abs_(),
        }
    groups = [
        {
            "lr": 1e-3,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.01,
            "amsgrad": False,
            "params": list(range(len(model))),
        }
    ]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}}


def make_templates(tree: Any) -> Any:
    """Same structure, fresh zeroed tensors: the into= targets of a load.

    Zeroed, not just allocated: a live model's memory has been written before it is restored into, and the raw
    read floor reads into a buffer that has too. An untouched template charged the first load the kernel's first
    touch of every page (about a second per GiB on a VM), which is not a cost of loading."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: make_templates(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [make_templates(v) for v in tree]
    return tree


def same_values(a: Any, b: Any) -> bool:
    """Bitwise equality of two trees' tensors (used to check loads really loaded)."""
    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(ta, tb, strict=False))


def mutate(tree: Any) -> None:
    """An in-place change to every tensor, as an optimizer step would make."""
    for t in tensors_of(tree):
        t.add_(1)


class MLP(torch.nn.Module):
    """The real torch.nn model of the training-loop measurement."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.width = width
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.net(x)  # Linear and GELU layers: a tensor (Module.__call__ is untyped)
        return y


def model_for_state_bytes(state_bytes: int, width: int = 512) -> MLP:
    """An MLP whose params + AdamW state (12 bytes/param) is about ``state_bytes``."""
    params_per_layer = width * width + width
    depth = max(1, state_bytes // (12 * params_per_layer))
    return MLP(width, int(depth))
