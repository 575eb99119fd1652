"""A seeded, bounded round-trip harness: random payloads through each of the four formats, sync and async
saves, with and without `into=` templates, under a `{rank}` layout. Each value either loads back exactly (bits,
dtype, shape, container types and keys, tensor identity where a template supplies it) or its save is refused
naming the item, with nothing committed.

What the design document lets a format change is normalised in the expectation, nothing else:

* a Torch file holds plain tensors (no `nn.Parameter`, no autograd state, no DTensor: `staging.as_written`)
  and writes a view compacted, so strides and `requires_grad` are not compared; tied weights load as one tensor;
* JSON writes tuples as lists and any Mapping as an object with sorted keys, and holds one NaN;
* a safetensors file is flat: without a template the load is the `name -> tensor` map of the dotted keys.

A failure prints the seed: `SEED=<n> pytest tests/test_value_fidelity_harness.py` replays every case with it.
"""

from __future__ import annotations

import math
import os
import random
import struct
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
    SerializationFormat,
    TorchSerialization,
)
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import IncompleteCheckpointError
from torch_checkpointing.safetensors_tree import stores_dtype
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.traversal import dotted_key, iter_leaves

SEEDS = [int(os.environ["SEED"])] if "SEED" in os.environ else list(range(6))
KEY = "item"
LAYOUT = "r{rank}/item_{rank}.bin"

# ------------------------------------------------------------------------------------------------ dtypes


def _torch_saves(dtype: torch.dtype) -> bool:
    """Whether `torch.save` can name `dtype` (uint1..7, int1..7 and the bits types it cannot)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is "experimental"
            torch.save(torch.empty(0, dtype=dtype), _Sink())
    except Exception:
        return False
    return True


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass


def _cpu_dtypes() -> list[torch.dtype]:
    """Every dtype this torch has whose CPU tensors can be made from bytes (all but the quantized ones)."""
    found = []
    for dtype in sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # quantized dtypes are deprecated (and refused here)
                torch.zeros(4 * dtype.itemsize, dtype=torch.uint8).view(dtype)
        except (RuntimeError, TypeError):
            continue
        found.append(dtype)
    return found


TORCH_DTYPES = [d for d in _cpu_dtypes() if _torch_saves(d)]
SAFETENSORS_DTYPES = [d for d in TORCH_DTYPES if stores_dtype(d)]


def test_the_harness_covers_the_dtypes_the_brief_names() -> None:
    named = {torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64}
    named |= {torch.complex128, torch.bool, torch.int8, torch.int16, torch.int32, torch.int64}
    named |= {torch.uint8, torch.uint16, torch.uint32, torch.uint64}
    assert named <= set(TORCH_DTYPES)
    assert named - {torch.complex128} <= set(SAFETENSORS_DTYPES)


# -------------------------------------------------------------------------------------------- generators


@dataclass
class Case:
    """One payload and what its load must give back: `tied` lists leaf paths that must load as one tensor."""

    value: Any
    tied: list[tuple[tuple[Any, ...], tuple[Any, ...]]]


class Gen:
    """Random values from one seed: tensors of every dtype and layout, and the leaves each format holds."""

    def __init__(self, seed: int, dtypes: list[torch.dtype]) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.dtypes = dtypes

    def bits(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of random bytes: NaNs with payloads, -0.0, infinities and subnormals come up by themselves."""
        n = math.prod(shape)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=self.gen).bool()
        raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=self.gen)
        return raw.view(dtype).reshape(shape)

    def tensor(self) -> torch.Tensor:
        dtype = self.rng.choice(self.dtypes)
        kind = self.rng.choice(["plain", "zero-dim", "empty", "strided", "transposed", "offset", "channels_last"])
        kind = self.rng.choice([kind, "expanded", "param"])
        if kind == "zero-dim":
            return self.bits((), dtype)
        if kind == "empty":
            return self.bits((0, self.rng.randint(0, 3)), dtype)
        if kind == "strided":
            return self.bits((4, 6), dtype)[:, :: self.rng.randint(2, 3)]
        if kind == "transposed":
            return self.bits((3, 5), dtype).t()
        if kind == "offset":
            return self.bits((5, 3), dtype)[self.rng.randint(1, 4)]
        if kind == "channels_last":
            return self.bits((2, 3, 2, 2), dtype).contiguous(memory_format=torch.channels_last)
        if kind == "expanded":
            return self.bits((3, 1), dtype).expand(3, 4)
        if kind == "param" and dtype.is_complex and self.rng.random() < 0.5:
            return self.bits((2, 3), dtype).conj()  # a lazy conjugate view: the file holds the conjugated values
        if kind == "param" and (dtype.is_floating_point or dtype.is_complex) and dtype.itemsize > 1:
            return torch.nn.Parameter(self.bits((2, 3), dtype), requires_grad=self.rng.random() < 0.5)
        return self.bits((self.rng.randint(1, 5),), dtype)

    def float(self) -> float:
        special = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.7976931348623157e308, 0.1]
        return self.rng.choice([*special, self.rng.uniform(-1e6, 1e6)])

    def int(self) -> int:
        return self.rng.choice([0, 1, -1, 2**31, -(2**63), 2**64 + 1, -(2**100), self.rng.randint(-9, 9)])

    def str(self) -> str:
        return self.rng.choice(["", "plain", "ünïcödé", "nul\x00inside", "emoji \U0001f600", "a.b/c", "\u202e"])

    def json_leaf(self) -> Any:
        return self.rng.choice([None, True, False, self.int(), self.float(), self.str()])

    def torch_leaf(self) -> Any:
        return self.rng.choice([self.json_leaf(), b"\x00\xffbytes", complex(self.float(), 1.0), self.tensor()])

    def key(self, kinds: str) -> Any:
        """A dict key: `s` str (with '.', '/', unicode, empty), `i` int, `t` tuple and None."""
        options: list[Any] = ["a", "b", "a.b", "0", "x/y", "ключ", "w", ""]
        if "i" in kinds:
            options += [0, 1, -3]
        if "t" in kinds:
            options += [(1, "a"), None]
        return self.rng.choice(options)

    def tree(self, leaf: Callable[[], Any], keys: str, depth: int = 0, tuples: bool = True) -> Any:
        roll = self.rng.random()
        if depth >= 3 or roll < 0.35:
            return leaf()
        width = self.rng.randint(0, 3)
        kids = [self.tree(leaf, keys, depth + 1, tuples) for _ in range(width)]
        if roll < 0.55:
            return kids
        if roll < 0.65 and tuples:
            return tuple(kids)
        mapping = OrderedDict() if roll < 0.7 else {}
        for kid in kids:
            mapping[self.key(keys)] = kid
        return mapping


def torch_case(seed: int) -> Case:
    g = Gen(seed, TORCH_DTYPES)
    value: dict[Any, Any] = {"tree": g.tree(g.torch_leaf, "sit"), "t": g.tensor()}
    base = g.bits((4, 4), torch.float32)
    value["tied_a"] = value["tied_b"] = base  # one tensor under two keys: loads as one tensor
    value["overlap"] = [base[:2], base[1:3]]  # overlapping views: each loads its own elements
    value["empty"] = {"d": {}, "l": [], "t": (), "nested": {"e": [[], {}]}}
    return Case(value, [(("tied_a",), ("tied_b",))])


def safetensors_case(seed: int) -> Case:
    g = Gen(seed, SAFETENSORS_DTYPES)
    value: dict[Any, Any] = {"tree": g.tree(g.tensor, "si", tuples=True), "t": g.tensor()}
    base = g.bits((3, 3), torch.bfloat16)
    value["tied_a"] = value["tied_b"] = base
    value["overlap"] = [base[:2], base[1:]]
    if g.rng.random() < 0.5:
        value["a.b"] = g.tensor()  # may collide with value["a"]["b"]: then the save must refuse it
        value["a"] = {"b": g.tensor()} if g.rng.random() < 0.5 else {"c": g.tensor()}
    return Case(value, [])


def json_case(seed: int) -> Case:
    g = Gen(seed, [])
    return Case({"tree": g.tree(g.json_leaf, "s"), "n": g.int(), "f": g.float(), "s": g.str()}, [])


def raw_case(seed: int) -> Case:
    g = Gen(seed, [])
    return Case(g.rng.randbytes(g.rng.choice([0, 1, 4095, 4096, 70_000])), [])


def many_tiny_tensors_case(seed: int) -> Case:
    g = Gen(seed, SAFETENSORS_DTYPES)
    return Case({f"p{i}": g.bits((g.rng.randint(0, 2),), g.rng.choice(g.dtypes)) for i in range(3000)}, [])


# ------------------------------------------------------------------------------------------ expectations


def same(expected: Any, got: Any, path: str = "") -> None:
    """`got` is `expected` exactly: container types, keys in order, leaf types (bool apart from int), float
    bits, tensor dtype, shape and bits."""
    where = path or "<item>"
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, saved a tensor"
        assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype}, saved {expected.dtype}"
        assert got.shape == expected.shape, f"{where}: shape {tuple(got.shape)}, saved {tuple(expected.shape)}"
        assert tensor_bits(got) == tensor_bits(expected), f"{where}: the bits differ"
        return
    assert type(got) is type(expected), f"{where}: {type(got).__name__}, saved {type(expected).__name__}"
    if isinstance(expected, Mapping):
        assert list(got.keys()) == list(expected.keys()), f"{where}: keys {list(got)}, saved {list(expected)}"
        for k in expected:
            same(expected[k], got[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), f"{where}: {len(got)} entries, saved {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            same(e, g, f"{path}[{i}]")
    elif isinstance(expected, (float, complex)):
        assert float_bits(got) == float_bits(expected), f"{where}: {got!r}, saved {expected!r}"
    else:
        assert got == expected, f"{where}: {got!r}, saved {expected!r}"


def float_bits(x: float | complex) -> bytes:
    """A float's (or a complex's two floats') IEEE bits: a NaN's payload and -0.0 count."""
    return struct.pack("<dd", x.real, x.imag) if isinstance(x, complex) else struct.pack("<d", x)


def tensor_bits(t: torch.Tensor) -> bytes:
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    return bytes(flat.view(torch.uint8).tolist()) if flat.numel() else b""


def as_json(value: Any) -> Any:
    """What a JSON file gives back for `value` (tuples as lists, Mappings as dicts with sorted keys)."""
    if isinstance(value, Mapping):
        return {k: as_json(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return value


def same_json(expected: Any, got: Any, path: str = "") -> None:
    """`same`, with JSON's one NaN: any NaN saved loads as the NaN."""
    if isinstance(expected, float) and math.isnan(expected):
        assert isinstance(got, float) and math.isnan(got), f"{path}: {got!r}, saved NaN"
    elif isinstance(expected, dict):
        assert type(got) is dict and list(got) == list(expected), f"{path}: keys {list(got)}, saved {list(expected)}"
        for k in expected:
            same_json(expected[k], got[k], f"{path}[{k!r}]")
    elif isinstance(expected, list):
        assert type(got) is list and len(got) == len(expected), f"{path}: {got!r}, saved {expected!r}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            same_json(e, g, f"{path}[{i}]")
    else:
        same(expected, got, path)


def flat_names(value: Any) -> list[str]:
    return [dotted_key(path) for path, _ in iter_leaves(value)]


def template_of(value: Any) -> Any:
    """An `into=` template of `value`'s structure: zeroed tensors of its dtypes and shapes (tied where it is)."""
    made: dict[int, torch.Tensor] = {}

    def build(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if id(v) not in made:
                made[id(v)] = torch.zeros(v.shape, dtype=v.dtype)
            return made[id(v)]
        if isinstance(v, Mapping):
            return type(v)((k, build(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return type(v)(build(x) for x in v)
        return v

    return build(value)


def template_tensors(template: Any) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    for path, leaf in iter_leaves(template):
        if isinstance(leaf, torch.Tensor):
            yield path, leaf


def at(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


# ---------------------------------------------------------------------------------------------- the runs

FORMATS: dict[str, tuple[SerializationFormat, Callable[[int], Case]]] = {
    "torch": (TorchSerialization(), torch_case),
    "safetensors": (SafetensorsSerialization(metadata={"k": "v"}), safetensors_case),
    "json": (JsonSerialization(), json_case),
    "raw": (RawSerialization(), raw_case),
}


def _manager(fmt: SerializationFormat, async_save: bool) -> CheckpointManager:
    save = AsyncCheckpointSaverConfig() if async_save else SyncCheckpointSaverConfig()
    return CheckpointManager(
        CheckpointManager.Config(
            items={KEY: ItemSpec(layout=LayoutInfo(LAYOUT, fmt))},
            save=save,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _save(manager: CheckpointManager, where: Path, value: Any) -> None:
    write = manager.save(str(where), {KEY: value})
    if write is not None:
        write.result(timeout=120)


def _collides(value: Any) -> bool:
    names = flat_names(value)
    return len(set(names)) != len(names)


def check_case(
    manager: CheckpointManager, name: str, case: Case, where: Path, with_template: bool, rank: int = 0
) -> None:
    """Save `case`, then load it back (into a template when asked) and compare; or see the save refuse it."""
    value = case.value
    if name == "safetensors" and _collides(value):
        with pytest.raises(ValueError, match=rf"item '{KEY}'.*flatten to the same key"):
            _save(manager, where, value)
        with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
            manager.load(str(where))
        return
    _save(manager, where, value)
    mine = where / f"r{rank}" / f"item_{rank}.bin"
    assert mine.is_file(), f"the {{rank}} layout was not expanded to rank {rank}'s file"
    template = template_of(value) if with_template else None
    got = manager.load(str(where), into={KEY: template})[KEY]
    if with_template:
        check_template_load(value, template, got)
    else:
        check_plain_load(name, case, got)


def check_plain_load(name: str, case: Case, got: Any) -> None:
    value = case.value
    if name == "json":
        same_json(as_json(value), got)
    elif name == "safetensors":
        expected = {dotted_key(path): leaf for path, leaf in iter_leaves(value)}
        assert sorted(got) == sorted(expected), f"names {sorted(got)}, saved {sorted(expected)}"
        for k, tensor in expected.items():
            same(tensor, got[k], k)
    else:
        same(_plain(value), got)
        for a, b in case.tied:
            assert at(got, a) is at(got, b), f"tied weights {a} and {b} loaded as two tensors"


def check_template_load(value: Any, template: Any, got: Any) -> None:
    """The merge keeps the template's tensors (identity) and container types, filled with the saved bits: the
    load gives back exactly what was saved, JSON's tuples and key order included (the template has them)."""
    for path, tensor in template_tensors(template):
        assert at(got, path) is tensor, f"{path}: the template's tensor was replaced"
    same(_plain(value), got)


def _plain(value: Any) -> Any:
    """`value` as a Torch file holds it: each tensor a plain tensor (a Parameter's data)."""
    if isinstance(value, torch.nn.Parameter):
        return value.detach()
    if isinstance(value, Mapping):
        return type(value)((k, _plain(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


@pytest.mark.parametrize("with_template", [False, True], ids=["no-template", "into"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_random_values_load_back_exactly_or_are_refused(
    name: str, async_save: bool, with_template: bool, tmp_path: Path
) -> None:
    fmt, make = FORMATS[name]
    with _manager(fmt, async_save) as manager:
        for seed in SEEDS:
            try:
                check_case(manager, name, make(seed), tmp_path / f"seed{seed}", with_template)
            except AssertionError as exc:
                raise AssertionError(f"SEED={seed}: {exc}") from exc


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["torch", "safetensors"])
def test_very_many_tiny_tensors_load_back_exactly(name: str, async_save: bool, tmp_path: Path) -> None:
    fmt, _ = FORMATS[name]
    case = many_tiny_tensors_case(SEEDS[0])
    with _manager(fmt, async_save) as manager:
        check_case(manager, name, case, tmp_path / "ck", with_template=False)
        check_case(manager, name, case, tmp_path / "ck2", with_template=True)


def test_the_harness_sees_a_value_that_comes_back_different() -> None:
    """The comparison can fail: a flipped NaN payload bit, -0.0 for 0.0, a list for a tuple, an int for a
    bool are each reported."""
    nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    other = torch.tensor([0x7FC00002], dtype=torch.int32).view(torch.float32)
    for expected, got in [(nan, other), (0.0, -0.0), ((1,), [1]), (True, 1), ({"a": 1, "b": 2}, {"b": 2, "a": 1})]:
        with pytest.raises(AssertionError):
            same(expected, got)


# ------------------------------------------------------------------------------------------------ rank 1


def _seed_for_both_ranks(make: Callable[[int], Case], start: int) -> int:
    """The first seed from `start` whose payloads on rank 0 and rank 1 (seed + 1000 * rank) save: a collective
    save refused on one rank fails on both, so both ranks take seeds that save (refusals are covered above)."""
    seed = start
    while any(_collides(make(seed + 1000 * rank).value) for rank in (0, 1)):
        seed += 1
    return seed


def harness_on_two_ranks(root: str) -> list[str]:
    """Rank function (module level, so spawned ranks import it): each rank saves its own random payload of each
    format, sync and async, under the `{rank}` layout, and loads its own back; returns what came back different."""
    import torch.distributed as dist

    rank, failures = dist.get_rank(), []
    for name, (fmt, make) in FORMATS.items():
        for async_save in (False, True):
            with _manager(fmt, async_save) as manager:
                for i, with_template in enumerate((False, True)):
                    seed = _seed_for_both_ranks(make, 10 * i + async_save)
                    where = Path(root) / f"{name}-{async_save}-{i}"
                    try:
                        check_case(manager, name, make(seed + 1000 * rank), where, with_template, rank)
                    except AssertionError as exc:
                        failures.append(f"rank {rank} {name} async={async_save} seed={seed + 1000 * rank}: {exc}")
    return failures


@pytest.mark.multirank
def test_rank_one_loads_back_its_own_values_exactly(tmp_path: Path) -> None:
    from simulator.launcher import launch

    results = launch(harness_on_two_ranks, 2, args=(str(tmp_path),), timeout=400)
    assert results == [[], []]
