"""Merging a loaded value into a caller's template (`into=`), in place wherever the template allows.

Tensors are filled with `copy_()` so the caller's objects (model parameters, optimizer state) keep their
identity; nothing is resized or cast silently. What is merged entry by entry is decided by the traversal's
container rule (any Mapping, list or tuple), the rule the save walked the value with: any other value (a
`UserList`, a `deque`, a `set`) was stored whole, so it is replaced whole, and a container never merges with
a leaf. An empty list or tuple is a container like any other: every stored entry under it is one the template
lacks (added to a list in place, reported, refused by `strict=True`), as under an empty dict.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, MutableMapping, Set
from typing import Any

import torch

from torch_checkpointing.errors import CorruptCheckpointError, TemplateMismatchError
from torch_checkpointing.traversal import (
    NestingError,
    freed_storage_said,
    is_container,
    is_sequence,
    local_tensor,
    rebuild,
    storage_freed,
)
from torch_checkpointing.types import CheckpointPath, NestedPath

__all__ = [
    "MISSING",
    "check_shared_targets",
    "check_tensor_fits",
    "check_writable",
    "copy_tensor_into",
    "overlapping_targets",
    "walk_checkpoint_structure",
]


class _Missing:
    """A leaf the source does not have (safetensors list/tuple parents); comes back as None."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

LeafFn = Callable[[CheckpointPath, Any, Any], Any]
_Copy = tuple[CheckpointPath, torch.Tensor, torch.Tensor]  # where, source, target
_Filled = tuple[CheckpointPath, Any, Any]  # where a template container was first met, its source, the container


def copy_tensor_into(where: CheckpointPath, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`target.copy_(source)` after checking shape and dtype; DTensors are copied through their local shards."""
    check_tensor_fits(where, source, target)
    src, dst = local_tensor(source), local_tensor(target)
    with torch.no_grad():
        dst.copy_(src)
    return target


def _compatible(template: Any, source: Any) -> bool:
    """A Mapping merges with a Mapping and a list/tuple with a list/tuple (JSON stores tuples as lists); a leaf
    replaces a leaf of a related type: numbers with numbers (bool apart), sets with sets, else a subclass."""
    if is_container(template) or is_container(source):
        both_mappings = isinstance(template, Mapping) and isinstance(source, Mapping)
        return both_mappings or (is_sequence(template) and is_sequence(source))
    if isinstance(template, numbers.Number) and isinstance(source, numbers.Number):
        return isinstance(template, bool) == isinstance(source, bool)
    if isinstance(template, Set) and isinstance(source, Set):
        return True
    return isinstance(template, type(source)) or isinstance(source, type(template))


def walk_checkpoint_structure(
    *,
    item_key: str,
    source: Any,
    target: Any = None,
    leaf_fn: LeafFn | None = None,
    dry_run: bool = False,
    unexpected: list[CheckpointPath] | None = None,
    at: NestedPath = (),
    copies: list[_Copy] | None = None,
    containers: dict[int, _Filled] | None = None,
    adopt: Callable[[Any], Any] | None = None,
) -> tuple[Any, list[CheckpointPath]]:
    """Merge `source` into `target`; returns the merged value and the template paths the source lacked.

    Entries the source holds and the template lacks are kept (added to mutable templates) and recorded in
    `unexpected`. `dry_run=True` checks every shape, dtype and type and records missing/unexpected paths
    without copying or changing anything, so a load can refuse before its first `copy_()`. `at` is where
    `source` and `target` sit in the item (for paths in reports and errors). A dry run given `copies` appends
    the tensor copies it found to that list and leaves the shared-memory check to the caller: a load of several
    items makes one `check_shared_targets` call over all of theirs, since two items' templates may share tensors.
    `containers` does the same for the template dicts and lists a dry run met (filled in place): one met again,
    in this item or another given the same dict, must receive the same saved value there. `adopt` is applied to
    every saved value returned as it is (where the template holds None, and entries the template lacks), in a dry
    run too: the loader makes its copies there, before any template changes.
    """
    missing: list[CheckpointPath] = []
    walker = _Walker(item_key, missing, unexpected if unexpected is not None else [], leaf_fn, dry_run)
    if adopt is not None:
        walker.adopt = adopt
    if containers is not None:
        walker.containers = containers
    try:
        merged = walker.merge(tuple(at), source, target)
    except RecursionError:
        raise NestingError((), cycle=False).for_item(item_key) from None
    if dry_run and copies is not None:
        copies.extend(walker.copies)
    elif dry_run:
        check_shared_targets(walker.copies)
    return merged, missing


def check_shared_targets(copies: list[_Copy]) -> None:
    """Refuse copies into template tensors that share memory (tied weights, overlapping views) unless every
    target still holds its own source once all are made: the later copy overwrote the earlier one's values, so
    the load returned one entry holding another entry's values, silently. Only tensors whose memory overlaps
    another's are compared: tied ones (the same view) by their sources, any other overlap by making the copies
    into a scratch copy of the storage (the template is not touched). The common case, no overlap, costs one
    sort of the targets' address ranges."""
    spans = sorted(span for span in map(_address_span, enumerate(copies)) if span is not None)
    group: list[_Copy] = []
    reach = -1
    for start, stop, index in spans:
        if start >= reach:
            _check_if_shared(group)
            group = []
        group.append(copies[index])
        reach = max(reach, stop)
    _check_if_shared(group)


def overlapping_targets(
    targets: list[tuple[CheckpointPath, torch.Tensor]],
) -> list[tuple[CheckpointPath, CheckpointPath]]:
    """Pairs of entries whose tensors' memory overlaps within one storage (tied weights, overlapping views):
    for a load whose copies the engine does not make itself, so cannot compare (a custom resharder's `load`).
    Found as `check_shared_targets` finds them: one sort of the address ranges."""
    copies: list[_Copy] = [(where, t, t) for where, t in targets]
    spans = sorted(span for span in map(_address_span, enumerate(copies)) if span is not None)
    pairs: list[tuple[CheckpointPath, CheckpointPath]] = []
    group: list[_Copy] = []
    reach = -1
    for start, stop, index in [*spans, (-1, -1, -1)]:  # the sentinel closes the last group
        if start >= reach or index < 0:
            pairs.extend(_pairs_per_storage(group))
            group = []
        if index >= 0:
            group.append(copies[index])
            reach = max(reach, stop)
    return pairs


def _pairs_per_storage(group: list[_Copy]) -> list[tuple[CheckpointPath, CheckpointPath]]:
    by_storage: dict[int, list[CheckpointPath]] = {}
    for where, _, target in group:
        by_storage.setdefault(local_tensor(target).untyped_storage().data_ptr(), []).append(where)
    return [(paths[0], other) for paths in by_storage.values() for other in paths[1:]]


def _address_span(indexed: tuple[int, _Copy]) -> tuple[int, int, int] | None:
    """The addresses a target's elements lie in, as [start, stop), with the copy's index; None for a target
    without memory of its own to share (empty, meta, not strided)."""
    index, (_, _, target) = indexed
    dst = local_tensor(target)
    if dst.layout != torch.strided:
        return None
    start = dst.data_ptr()
    if not start or not dst.numel():
        return None
    if dst.is_contiguous():
        return start, start + dst.nbytes, index
    low, high = _span(dst)
    base = start - int(dst.storage_offset()) * dst.element_size()
    return base + low, base + high, index


def _check_if_shared(group: list[_Copy]) -> None:
    """Check targets whose memory overlaps, per storage (two storages over one memory are not compared)."""
    if len(group) < 2:
        return
    by_storage: dict[int, list[_Copy]] = {}
    for copy in group:
        by_storage.setdefault(local_tensor(copy[2]).untyped_storage().data_ptr(), []).append(copy)
    for shared in by_storage.values():
        if len(shared) > 1:
            _check_group(shared)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a strided tensor's elements lie in, as [start, end)."""
    low = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if st < 0)
    high = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if st > 0)
    size = t.element_size()
    offset = int(t.storage_offset())
    return (offset + low) * size, (offset + high + 1) * size


def _view_of(t: torch.Tensor) -> tuple[Any, ...]:
    return t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _check_group(group: list[_Copy]) -> None:
    """Tied targets (one view) must receive equal sources; targets overlapping otherwise are replayed."""
    if len({_view_of(local_tensor(target)) for _, _, target in group}) > 1:
        _replay(group)
        return
    where, first, _ = group[0]
    for other, source, _ in group[1:]:
        if source is not first and not _same_bits(local_tensor(source), local_tensor(first)):
            raise _shared_memory_error(where, other)


def _replay(group: list[_Copy]) -> None:
    """Make the group's copies, in the load's order, into a scratch copy of their storage, then check that each
    target reads back its own source bit for bit."""
    scratch = local_tensor(group[0][2]).untyped_storage().clone()
    views = []
    with torch.no_grad():
        for where, source, target in group:
            dst = local_tensor(target)
            view = torch.empty(0, dtype=dst.dtype, device=dst.device)
            view.set_(scratch, dst.storage_offset(), dst.shape, dst.stride())
            view.copy_(local_tensor(source))
            views.append((where, view, local_tensor(source), _span(dst)))
    for where, view, source, span in views:
        if not _same_bits(view, source):
            other = next(w for w, _, _, s in views if w != where and s[0] < span[1] and span[0] < s[1])
            raise _shared_memory_error(where, other)


def _shared_memory_error(where: CheckpointPath, other: CheckpointPath) -> TemplateMismatchError:
    return TemplateMismatchError(
        f"Template entries at {where} and {other} share memory (tied weights, or overlapping views of one "
        f"tensor), but the checkpoint holds different values for them: the load would leave one holding the "
        f"other's values. Untie them in the template (e.g. .clone() one) and tie them again after the load, or "
        f"pass None to take the stored tensors."
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN payload and -0.0 included), whatever the dtype."""
    a, b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _as_it_is(value: Any) -> Any:
    return value


class _Walker:
    def __init__(
        self,
        key: str,
        missing: list[CheckpointPath],
        unexpected: list[CheckpointPath],
        leaf_fn: LeafFn | None,
        dry_run: bool,
    ) -> None:
        self.key, self.missing, self.unexpected, self.leaf_fn, self.dry_run = key, missing, unexpected, leaf_fn, dry_run
        self._on_path: set[int] = set()  # ids of the source containers being merged: one met again is a cycle
        self.copies: list[_Copy] = []  # the tensor copies a dry run found, for `check_shared_targets`
        self.containers: dict[int, _Filled] = {}  # the template containers a dry run met, filled in place
        self.adopt: Callable[[Any], Any] = _as_it_is  # applied to a saved value returned as it is

    def merge(self, path: NestedPath, source: Any, target: Any) -> Any:
        here = CheckpointPath(self.key, path)
        if source is MISSING:
            self.missing.append(here)
            return None
        if target is None:
            return self.adopt(source)
        if isinstance(target, torch.Tensor):
            if not isinstance(source, torch.Tensor):
                raise _type_error(here, target, source)
            if self.dry_run:
                check_tensor_fits(here, source, target)
                self.copies.append((here, source, target))
                return target
            if self.leaf_fn is not None:
                return self.leaf_fn(here, source, target)
            return copy_tensor_into(here, source, target)
        if not _compatible(target, source):
            raise _type_error(here, target, source)
        if is_container(target):
            return self._merge_container(path, source, target)
        if self.leaf_fn is not None and not self.dry_run:
            return self.leaf_fn(here, source, target)
        return source

    def _merge_container(self, path: NestedPath, source: Any, target: Any) -> Any:
        """Merge entry by entry; a source that contains itself (with a template that does too, else the
        template's end stops the walk) is a `NestingError` naming the path, not an endless recursion."""
        if id(source) in self._on_path:
            raise NestingError(path, cycle=True).for_item(self.key)
        if self.dry_run and isinstance(target, (list, MutableMapping)):
            self._check_filled_once(CheckpointPath(self.key, path), source, target)
        self._on_path.add(id(source))
        if isinstance(target, Mapping):
            merged = self._merge_mapping(path, source, target)
        else:
            merged = self._merge_sequence(path, source, target)
        self._on_path.discard(id(source))
        return merged

    def _check_filled_once(self, here: CheckpointPath, source: Any, target: Any) -> None:
        """A template dict or list is updated in place: reached at two places (one object under two keys, or in
        two items), the second fill overwrote the first, and the load returned the second saved value at both,
        silently. Refused unless both places hold the same saved value (a pickle keeps such sharing)."""
        seen = self.containers.setdefault(id(target), (here, source, target))
        if seen[2] is not target or seen[1] is source or _same_value(seen[1], source):
            return
        raise TemplateMismatchError(
            f"Template entries at {seen[0]} and {here} are one {type(target).__name__} (the same object reached at "
            f"two places), but the checkpoint holds different values for them: the load fills it in place, so "
            f"both would come back holding the values saved at {here}. Pass separate containers (e.g. "
            f"copy.deepcopy one), or None to take the stored values."
        )

    def _merge_mapping(self, path: NestedPath, source: Mapping[Any, Any], target: Mapping[Any, Any]) -> Any:
        # In place where the template allows; a dry run changes nothing of the caller's.
        out: MutableMapping[Any, Any] = (
            target if isinstance(target, MutableMapping) and not self.dry_run else dict(target)
        )
        for k in list(target.keys()):
            if k in source:
                out[k] = self.merge((*path, k), source[k], target[k])
            else:
                self.missing.append(CheckpointPath(self.key, (*path, k)))
        for k in source:
            if k not in target and source[k] is not MISSING:
                self.unexpected.append(CheckpointPath(self.key, (*path, k)))
                out[k] = self.adopt(source[k])
        if out is target or self.dry_run:
            return out
        where = str(CheckpointPath(self.key, path))
        return rebuild(target, dict(out), where)  # an immutable Mapping keeps its type where it can be rebuilt

    def _merge_sequence(self, path: NestedPath, source: list[Any] | tuple[Any, ...], target: Any) -> Any:
        merged = [
            self.merge((*path, i), source[i], t) if i < len(source) else _record(self.missing, self.key, path, i, t)
            for i, t in enumerate(target)
        ]
        extra = [self.adopt(v) for v in source[len(target) :]]
        self.unexpected.extend(CheckpointPath(self.key, (*path, i)) for i in range(len(target), len(source)))
        if self.dry_run:
            return merged
        if isinstance(target, list):
            for i, value in enumerate(merged):
                target[i] = value
            target.extend(extra)
            return target
        where = str(CheckpointPath(self.key, path))
        if hasattr(target, "_fields"):
            return rebuild(target, merged, where)  # a named tuple cannot grow: extras are reported, not kept
        return rebuild(target, [*merged, *extra], where)


def check_tensor_fits(where: CheckpointPath, source: torch.Tensor, target: torch.Tensor) -> None:
    """Raise `TemplateMismatchError` unless `source` can be copied into `target` as it is."""
    src, dst = local_tensor(source), local_tensor(target)
    if src.device.type == "meta":
        raise CorruptCheckpointError(
            f"The checkpoint holds a meta tensor at {where} (shape {tuple(src.shape)}, {src.dtype}, no values): "
            f"it was saved from an unmaterialised model and has nothing to load. Load it with None as the template "
            f"to inspect it, and re-save from a materialised model (module.to_empty(device=...) then initialise)."
        )
    if src.is_nested or dst.is_nested:  # a nested tensor has no one shape to compare (`.shape` raises)
        _check_nested_fits(where, src, dst)
    elif src.shape != dst.shape:
        raise TemplateMismatchError(
            f"Shape mismatch at {where}: checkpoint holds {tuple(src.shape)}, template has {tuple(dst.shape)}. "
            f"Build the template with the saved shape (or reshard with a Resharder); nothing is resized."
        )
    if src.dtype != dst.dtype:
        raise TemplateMismatchError(
            f"Dtype mismatch at {where}: checkpoint holds {src.dtype}, template has {dst.dtype}. "
            f"Load into a template of the saved dtype and convert afterwards."
        )
    if src.layout != dst.layout:
        raise TemplateMismatchError(
            f"Layout mismatch at {where}: checkpoint holds a {src.layout} tensor, template is {dst.layout}; "
            f"copy_() does not convert between them. Pass a template of the saved layout, or None to take the "
            f"stored tensor as is."
        )
    _check_kind_fits(where, src, dst)
    check_writable(where, dst)


def _check_nested_fits(where: CheckpointPath, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.is_nested != dst.is_nested or src.layout != dst.layout or _nested_sizes(src) != _nested_sizes(dst):
        raise TemplateMismatchError(
            f"Nested tensor mismatch at {where}: checkpoint holds {_nested_kind(src)}, template is "
            f"{_nested_kind(dst)}; copy_() fills a nested template only from one of the same layout and component "
            f"shapes. Pass such a template, or None to take the stored tensor as is."
        )


def _nested_sizes(t: torch.Tensor) -> list[tuple[int, ...]] | None:
    return [tuple(c.shape) for c in t.unbind()] if t.is_nested else None


def _nested_kind(t: torch.Tensor) -> str:
    if not t.is_nested:
        return f"a tensor of shape {tuple(t.shape)}"
    return f"a {t.layout} nested tensor of component shapes {_nested_sizes(t)}"


def _check_kind_fits(where: CheckpointPath, src: torch.Tensor, dst: torch.Tensor) -> None:
    """What copy_() needs beyond shape, dtype and layout, refused before the first copy (a raw RuntimeError
    midway before, with earlier items already overwritten): the same quantization scheme, and for a sparse
    compressed template the same number of stored elements (it cannot grow its index arrays in place)."""
    if src.is_quantized or dst.is_quantized:
        held, wanted = _qscheme(src), _qscheme(dst)
        if held != wanted:
            raise TemplateMismatchError(
                f"Quantization mismatch at {where}: checkpoint holds {held}, template is {wanted}; copy_() does "
                f"not convert between them. Pass a template quantized the same way, or None to take the stored "
                f"tensor as is."
            )
    if src.layout in _SPARSE_COMPRESSED and src._nnz() != dst._nnz():
        raise TemplateMismatchError(
            f"Sparse tensor mismatch at {where}: checkpoint holds {src._nnz()} stored elements, the {dst.layout} "
            f"template {dst._nnz()}; a compressed sparse template is filled in place only with as many. Pass "
            f"None to take the stored tensor as is."
        )


_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _qscheme(t: torch.Tensor) -> str:
    return f"a tensor quantized {t.qscheme()}" if t.is_quantized else "a tensor that is not quantized"


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether elements of the strided tensor `t` share memory (an expanded view, an unfold with a step smaller
    than its size), so that it cannot hold distinct values. Its dimensions sorted by stride, each stride must
    pass the reach of those before it; a layout that fails this (interleaved strides) is checked exactly."""
    if t.layout != torch.strided or t.numel() <= 1 or t.is_contiguous():
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    reach = 0
    for st, n in dims:
        if st <= reach:
            return _offsets_repeat(dims)
        reach += (n - 1) * st
    return False


def _offsets_repeat(dims: list[tuple[int, int]]) -> bool:
    """Whether two index tuples of a layout (stride, size per dimension) reach one memory offset."""
    offsets = torch.zeros(1, dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets.unsqueeze(1) + torch.arange(n, dtype=torch.int64) * st).flatten()
    return bool(torch.unique(offsets).numel() < offsets.numel())


def check_writable(where: object, target: torch.Tensor) -> None:
    """Raise `TemplateMismatchError` unless `copy_()` can fill `target` in place (checked before the first copy,
    so a template that cannot be filled refuses the load instead of failing it halfway, with earlier items
    already overwritten)."""
    fix = "Pass a template that owns its memory (e.g. torch.empty_like(...) or .clone()), or None to take the value."
    if target.device.type == "meta":
        raise TemplateMismatchError(
            f"Template at {where} is on the meta device: it has no memory to load into, so the load would return "
            f"it unfilled. Materialize it first (module.to_empty(device=...)) or pass None to take the stored tensor."
        )
    if target.is_inference() and not torch.is_inference_mode_enabled():
        raise TemplateMismatchError(
            f"Template at {where} is an inference tensor (made under torch.inference_mode()), which cannot be "
            f"updated in place outside it. {fix}"
        )
    if storage_freed(target):
        raise TemplateMismatchError(
            f"Template at {where} is {freed_storage_said(target)}: copying into it crashes the process. {fix}"
        )
    if _overlaps_itself(target):
        raise TemplateMismatchError(
            f"Template at {where} is a view whose elements share memory (an expanded view, or an unfold with a "
            f"step smaller than its size): several of its elements are one memory location, so it cannot hold the "
            f"saved values. {fix}"
        )


def _same_value(a: Any, b: Any) -> bool:
    """Whether two saved values are the same: containers entry by entry, tensors bit for bit (shape, dtype)."""
    try:
        return _same_tree(a, b)
    except (RecursionError, RuntimeError, TypeError, ValueError):  # no comparison says they are equal
        return False


def _same_tree(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        x, y = local_tensor(a), local_tensor(b)
        if x.shape != y.shape or x.dtype != y.dtype or x.layout != y.layout or x.layout != torch.strided:
            return False
        return x.device.type != "meta" and _same_bits(x, y)
    if isinstance(a, Mapping):
        return list(a) == list(b) and all(_same_tree(a[k], b[k]) for k in a)
    if is_sequence(a):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _record(missing: list[CheckpointPath], key: str, path: NestedPath, index: int, keep: Any) -> Any:
    missing.append(CheckpointPath(key, (*path, index)))
    return keep


def _type_error(where: CheckpointPath, target: Any, source: Any) -> TemplateMismatchError:
    rule = ""
    if is_container(target) != is_container(source):
        leaf = source if is_container(target) else target
        rule = (
            f" Only Mappings, lists and tuples are merged entry by entry; a {type(leaf).__name__} is saved and "
            f"loaded as one value."
        )
    return TemplateMismatchError(
        f"Target value at nested_path={where.nested_path!r} of item '{where.item_key}' is set to "
        f"{type(target).__name__}, but source value is {type(source).__name__}.{rule} Pass a template of the "
        f"saved type, or None to take the stored value as is."
    )
