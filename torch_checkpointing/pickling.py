"""Naming the value a save cannot pickle or deep-copy: the item, the nested path, the type, and the fix.

`torch.save`, `copy.deepcopy` or `pickle.dumps` of a whole item fails with the innermost object's complaint
("cannot pickle '_thread.lock' object") and not a word of where it sits. Every place a save pickles or copies
an item reports through `unpicklable`, which looks for the culprit only once the whole operation has failed,
so the common path pays nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import pickle
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

from torch_checkpointing.errors import ConfigTypeError, is_shortage
from torch_checkpointing.traversal import dotted_key, freed_storage_said, iter_leaves, storage_freed
from torch_checkpointing.types import NestedPath

__all__ = [
    "SUB_BYTE_DTYPES",
    "OutOfBand",
    "callback_unpicklable",
    "dumps_out_of_band",
    "fails_at_a_non_tensor",
    "found_in",
    "found_with_ids",
    "plain_pickle_keeps",
    "raised_by_a_leaf",
    "tensors_found_in",
    "unpicklable",
]


def fails_at_a_non_tensor(value: Any, op: Callable[[Any], object]) -> bool:
    """Whether the first leaf of `value` that fails `op` is not a tensor: a caller whose error speaks of a
    tensor (one `op` cannot take whole) words it for the object to blame instead."""
    found = _first_failing_leaf(value, op)
    return found is not None and not isinstance(found[1], torch.Tensor)


def unpicklable(
    key: str, value: Any, exc: BaseException, *, doing: str, op: Callable[[Any], object], fix: str
) -> pickle.PicklingError:
    """The error for item `key` whose `value` failed `op` (raising `exc`) while being `doing`, with `fix`."""
    found = _first_failing_leaf(value, op)
    if found is None:  # a container itself, or a failure no single leaf shows
        return pickle.PicklingError(f"Item '{key}' cannot be {doing}: {type(exc).__name__}: {exc}. {fix}")
    path, leaf, leaf_exc = found
    where = f"{key}::{dotted_key(path)}" if path else key
    return pickle.PicklingError(
        f"Item '{key}' cannot be {doing}: the value at '{where}' (a {_kind(leaf)}) fails: "
        f"{type(leaf_exc).__name__}: {leaf_exc}. {fix}"
    )


# Callbacks found picklable: every save() and load() rechecks these live fields, and pickling the same callback
# (a bound method pickles its object) at each call was work the write repeats anyway. A callable object's state
# may stop pickling later (given a lock): the write then finds out, and forgets it here (`cached=False`).
_PICKLABLE_CALLBACKS: weakref.WeakSet[Any] = weakref.WeakSet()


def callback_unpicklable(owner: str, name: str, value: Any, cached: bool = True) -> ConfigTypeError | None:
    """The error for callback field `owner.name` when `value` cannot be pickled for the async writer process,
    which runs it (API_SURFACE §9.2); None when it pickles (or is None). `cached=False`: pickle it again even if
    it was found picklable before."""
    if value is None or (cached and _known_picklable(value)):
        return None
    try:
        ForkingPickler.dumps(value)
    except Exception as exc:  # a callable object's own __reduce__ may raise anything
        with contextlib.suppress(TypeError):
            _PICKLABLE_CALLBACKS.discard(value)
        error = ConfigTypeError(
            f"{owner}.{name} cannot be pickled for the async writer process, which runs it ({type(exc).__name__}: "
            f"{exc}). Define it at module level (importable by name; bind arguments with functools.partial), or "
            f"use CheckpointManager.Config.with_sync_save(), which runs it in this process."
        )
        error.__cause__ = exc
        return error
    with contextlib.suppress(TypeError):  # neither hashable nor weakly referenceable: checked at each call
        _PICKLABLE_CALLBACKS.add(value)
    return None


def _known_picklable(value: Any) -> bool:
    try:
        return value in _PICKLABLE_CALLBACKS
    except TypeError:
        return False


def raised_by_a_leaf(
    key: str, value: Any, exc: Exception, *, doing: str, op: Callable[[Any], object], fix: str
) -> pickle.PicklingError | None:
    """`unpicklable` for an exception of any type (a `__reduce__`/`__getstate__`/`__deepcopy__` may raise
    RuntimeError, ValueError, OSError...), or None when no leaf of `value` fails `op`: then `exc` came from
    elsewhere (the stream's I/O error, a signal handler) and the caller raises it as itself. None too when `exc`
    is the process short of memory (`errors.is_shortage`): the leaf's own pickle, run again to find it, failed
    for want of memory too, and the save called a bytes object "not picklable" ("Make it picklable")."""
    if is_shortage(exc):
        return None
    found = _first_failing_leaf(value, op)
    return None if found is None else unpicklable(key, value, exc, doing=doing, op=op, fix=fix)


class _Finder(pickle.Pickler):
    """Pickles into nothing, to find the objects `pred` accepts: pickling reaches what a value holds the way the
    copy or the file will (its `__reduce__`/`__getstate__`), with no copy made. Neither a tensor's data nor a
    numeric numpy array's is written (an array's pickle would copy its data)."""

    def __init__(self, pred: Callable[[Any], bool]) -> None:
        super().__init__(_NullSink(), protocol=pickle.HIGHEST_PROTOCOL)
        self._pred = pred
        self.found: list[Any] = []

    def persistent_id(self, obj: Any) -> Any:  # called for every object pickled, containers included
        if self._pred(obj):
            self.found.append(obj)
        return 0 if isinstance(obj, torch.Tensor) or _numeric_array(obj) else None


class _TensorFinder(pickle.Pickler):
    """`_Finder` for objects of types other than the exact built-in ones (tensors, a user's objects), through
    `reducer_override`: the C pickler walks the exact built-in types (dict, list, tuple, str, int, float...)
    without calling it, where `persistent_id` ran in Python for every object. On a value holding many small
    records that look cost more than the staging's deep copy of it."""

    def __init__(self, pred: Callable[[Any], bool] = lambda obj: isinstance(obj, torch.Tensor)) -> None:
        super().__init__(_NullSink(), protocol=pickle.HIGHEST_PROTOCOL)
        self._pred = pred
        self.found: list[Any] = []

    def reducer_override(self, obj: Any) -> Any:
        if self._pred(obj):
            self.found.append(obj)
        return _NOT_WRITTEN if isinstance(obj, torch.Tensor) or _numeric_array(obj) else NotImplemented


_NOT_WRITTEN = (int, ())  # what a tensor or numeric array is pickled as by the finders: neither data is copied


def _numeric_array(obj: Any) -> bool:
    return isinstance(obj, np.ndarray) and not obj.dtype.hasobject


class _NullSink:
    def write(self, data: Any) -> int:
        return len(data)


def tensors_found_in(value: Any) -> list[torch.Tensor] | None:
    """The tensors `value` holds, as a pickle of it would meet them (each once); None where the pickling fails."""
    finder = _TensorFinder()
    try:
        finder.dump(value)
    except Exception:
        return None
    return finder.found


def found_with_ids(value: Any, pred: Callable[[Any], bool]) -> tuple[list[Any], set[int]] | None:
    """What `pred` accepts among the objects of `value` that are not of an exact built-in type (each once), and
    the ids of every object a pickle of `value` meets but ints, floats, bools, None and the empty tuple (its
    containers included, for the caller to match by id); None where the pickling fails."""
    finder = _TensorFinder(pred)
    try:
        finder.dump(value)
    except Exception:
        return None
    return finder.found, set(finder.memo.copy())


def found_in(value: Any, pred: Callable[[Any], bool]) -> list[Any] | None:
    """The objects `pred` accepts that `value` holds, as a pickle of it would meet them (one met twice is
    listed twice); None where the pickling fails."""
    finder = _Finder(pred)
    try:
        finder.dump(value)
    except Exception:
        return None
    return finder.found


def _kind(leaf: Any) -> str:
    return f"Tensor of dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__


def _first_failing_leaf(value: Any, op: Callable[[Any], object]) -> tuple[NestedPath, Any, Exception] | None:
    """The first leaf (depth first) on which `op` raises. A tensor is tried as an empty tensor of its dtype,
    once per dtype: its data is never the culprit (and pickling it to find out would copy it), but its dtype
    can be one torch.save has no name for (uint1..uint7, int1..int7: a bare `KeyError` before)."""
    tried: set[torch.dtype] = set()
    for path, leaf in iter_leaves(value):
        probe = _dtype_probe(leaf, tried)
        if probe is None:
            continue
        try:
            op(probe)
        except Exception as exc:
            return path, leaf, exc
    return None


def _dtype_probe(leaf: Any, tried: set[torch.dtype]) -> Any:
    """What to try `op` on for `leaf`: itself, an empty tensor of a dtype not yet tried, or None (skip it)."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if leaf.dtype in tried or leaf.layout != torch.strided or leaf.is_quantized:
        return None
    tried.add(leaf.dtype)
    return torch.empty(0, dtype=leaf.dtype)


class _WholePickler(pickle.Pickler):
    """Plain pickling writes a tensor's storage in torch's legacy format, whose loader has no storage class for
    uint16/32/64, the float8 types, complex32 and the bits types (a bare `AttributeError: ... UntypedStorage ...
    has no attribute 'dtype'` in the writer): such a tensor, where it is pickled in band, travels as
    `torch.save` bytes instead, which hold every dtype torch can name."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not plain_pickle_keeps(obj.dtype):
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            return _tensor_from_torch_bytes, (buffer.getvalue(),)
        return NotImplemented


def _tensor_from_torch_bytes(data: bytes) -> torch.Tensor:
    """The tensor `_WholePickler` wrote as `torch.save` bytes (the engine's own bytes, read back by itself)."""
    tensor: torch.Tensor = torch.load(io.BytesIO(data), weights_only=False)
    return tensor


@functools.cache
def plain_pickle_keeps(dtype: torch.dtype) -> bool:
    """Whether `pickle.loads(pickle.dumps(t))` gives a tensor of `dtype` back: asked of torch itself, once per
    dtype (its legacy storage table and its dtypes do not grow in step)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is "experimental"
            back = pickle.loads(pickle.dumps(torch.empty(0, dtype=dtype)))
    except Exception:
        return False
    return bool(back.dtype == dtype)


# ------------------------------------------------------------------------------------------------ out of band


@dataclass
class OutOfBand:
    """A value on its way to the writer process with its tensors' bytes outside the pickle.

    `header` is pickle bytes whose storages name, by index (pickle's persistent ids), buffers of `sizes` bytes;
    the buffers travel on the pipe right after the message that holds this (the trainer writes them from the
    tensors' own memory, without the GIL) and the writer reads each into a bytearray of its own, which the
    rebuilt tensor then uses. `received` is the writer's side only and never travels.
    """

    header: bytes
    sizes: list[int]
    received: list[bytearray] | None = field(default=None, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {"header": self.header, "sizes": self.sizes, "received": None}

    def loads(self) -> Any:
        if self.received is None or len(self.received) != len(self.sizes):
            raise RuntimeError("the out-of-band buffers of a requires_copy=False value were not received")
        return _OutOfBandUnpickler(io.BytesIO(self.header), self.received).load()


def dumps_out_of_band(value: Any) -> tuple[OutOfBand, list[memoryview], list[Any]]:
    """`value` pickled with the bytes of every plain CPU tensor's storage left out: (the header, a view of each
    storage's memory in index order, the storages those views need alive until they are sent).

    Pickling a GiB in band copied it twice under the GIL on the trainer's side (the storage into the pickle,
    the pickle into the message) and twice more in the writer, and a `requires_copy=False` save took 6-12 s to
    durable against 1 s for a staged one. A tensor the plain path reduces in its own way (a subclass, a
    quantized, sparse or lazy-bit tensor, user attributes, a non-leaf that requires grad) and a sub-byte dtype
    are pickled in band (a dtype plain pickling cannot give back as `torch.save` bytes: `_WholePickler`).
    Storages shared by several tensors travel once and stay shared.
    """
    stream = io.BytesIO()
    pickler = _OutOfBandPickler(stream, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dump(value)
    return OutOfBand(stream.getvalue(), [len(v) for v in pickler.views]), pickler.views, pickler.keep


def _tensor_from_storage(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
) -> torch.Tensor:
    tensor = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


class _OutOfBandPickler(_WholePickler):
    """Each eligible tensor reduces to `_tensor_from_storage` over its storage, and each storage (one wrapper
    per storage, keyed by its C++ object) pickles as the persistent id naming its buffer."""

    def __init__(self, stream: io.BytesIO, **kwargs: Any) -> None:
        super().__init__(stream, **kwargs)
        self.views: list[memoryview] = []
        self.keep: list[torch.UntypedStorage] = []  # the wrapper objects whose ids are persistent ids
        self._by_cdata: dict[int, torch.UntypedStorage] = {}
        self._index: dict[int, int] = {}  # id(wrapper) -> buffer index

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and _goes_out_of_band(obj):
            if storage_freed(obj):
                raise ValueError(f"{freed_storage_said(obj)}: save the sharded state, or leave it out of the save")
            args = (self._storage(obj), obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride())
            return _tensor_from_storage, (*args, obj.requires_grad)
        return super().reducer_override(obj)

    def persistent_id(self, obj: Any) -> int | None:
        return self._index.get(id(obj)) if isinstance(obj, torch.UntypedStorage) else None

    def _storage(self, tensor: torch.Tensor) -> torch.UntypedStorage:
        storage = tensor.untyped_storage()
        known = self._by_cdata.get(storage._cdata)
        if known is not None:
            return known
        n = storage.nbytes()
        memory: Any = (ctypes.c_char * n).from_address(storage.data_ptr()) if n else bytearray()
        self._by_cdata[storage._cdata] = storage
        self._index[id(storage)] = len(self.views)
        self.views.append(memoryview(memory).cast("B"))
        self.keep.append(storage)
        return storage


class _OutOfBandUnpickler(pickle.Unpickler):
    """One storage per buffer, however many tensors name it: pickle does not memoize persistent ids, and two
    storages over one buffer are two to torch.save (it tells them apart by their C++ object), which wrote the
    bytes twice and loaded back independent tensors the caller's held over one memory."""

    def __init__(self, stream: io.BytesIO, buffers: list[bytearray]) -> None:
        super().__init__(stream)
        self._buffers = buffers
        self._made: dict[Any, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> torch.UntypedStorage:
        made = self._made.get(pid)
        if made is None:
            made = self._made[pid] = _storage_over(self._buffers[pid])
        return made


def _storage_over(buffer: bytearray) -> torch.UntypedStorage:
    if not len(buffer):
        return torch.empty(0, dtype=torch.uint8).untyped_storage()
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def _goes_out_of_band(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and not t.is_quantized
        and not t.is_nested
        and not t.is_conj()
        and not t.is_neg()
        and (t.is_leaf or not t.requires_grad)
        and not getattr(t, "__dict__", None)
        and t.dtype not in SUB_BYTE_DTYPES
    )


SUB_BYTE_DTYPES = frozenset(
    getattr(torch, f"{sign}int{bits}")
    for sign in ("u", "")
    for bits in range(1, 8)
    if hasattr(torch, f"{sign}int{bits}")
)
"""uint1..uint7, int1..int7: torch has the dtypes but no kernels (no copy, no pickling) for them."""
