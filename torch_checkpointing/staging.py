"""Staging: the copy of `requires_copy=True` values that lets training go on while a save is written.

Tensors are copied into one host slab that is kept from one save to the next while the state keeps its layout
(shapes and dtypes in traversal order), so a warm save allocates nothing and costs one memory copy. The slab
lives in shared memory so the background writer process maps it once and reads it without another copy; with
CUDA it is also page-locked (cudaHostRegister) so device-to-host copies run non-blocking.
"""

from __future__ import annotations

import copy
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_checkpointing.types import STATE_DICT

__all__ = ["CheckpointStager", "CheckpointStagerConfig", "DefaultStager", "SlabRef", "unwrap_dtensor"]


def _cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclass
class CheckpointStagerConfig:
    """How `requires_copy=True` values are copied before an async write: memory kind and scheduling."""

    use_pinned_memory: bool = field(default_factory=_cuda_available)
    use_shared_memory: bool = True
    # False: save() returns once the copy is done, so the loop may mutate right away (the design document's
    # promise for requires_copy=True). True: the copy overlaps the caller's next work, and in-place updates
    # must then go inside CheckpointManager.lock(), which waits for the copy.
    use_async_staging: bool = False
    use_non_blocking_copy: bool = field(default_factory=_cuda_available)
    thread_name: str = "ckpt-staging"
    metric_prefix: str = "train.checkpoint_write"


def unwrap_dtensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (checkpoint files hold local shards; layout lives in the metadata)."""
    if type(t).__name__ == "DTensor" and hasattr(t, "to_local"):
        return t.to_local()
    return t


class CheckpointStager(ABC):
    @abstractmethod
    def stage(self, state_dict: STATE_DICT, keys_not_requiring_copy: Collection[str] = ()) -> STATE_DICT | Future[STATE_DICT]: ...

    @abstractmethod
    def get_staged_state_dict(self) -> STATE_DICT | None: ...

    @abstractmethod
    def close(self) -> None: ...

    def pinned_num_bytes(self) -> int:
        return 0


@dataclass(frozen=True)
class SlabRef:
    """Where a staged tensor lives in the slab: sent to the writer process instead of the tensor itself."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


_ALIGN = 64


class DefaultStager(CheckpointStager):
    """Copies every tensor of a save into one shared-memory slab, reused while the state keeps its layout.

    One slab (not one buffer per tensor) means one allocation, one page-locking call with CUDA, and one
    file descriptor for the writer process to map, however many tensors the state holds.
    """

    def __init__(self, config: CheckpointStagerConfig | None = None) -> None:
        self.config = config or CheckpointStagerConfig()
        cuda = torch.cuda.is_available()
        if (self.config.use_pinned_memory or self.config.use_non_blocking_copy) and not cuda:
            warnings.warn("CheckpointStagerConfig asks for pinned memory / non-blocking copies but CUDA is not "
                          "available; staging uses plain host memory.", stacklevel=2)
        self._pin = self.config.use_pinned_memory and cuda
        self._non_blocking = self.config.use_non_blocking_copy and cuda
        self._slab: torch.Tensor | None = None
        self._layout: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()
        self._views: list[torch.Tensor] = []
        self._generation = 0
        self._staged: STATE_DICT | None = None

    @property
    def slab(self) -> torch.Tensor | None:
        return self._slab

    @property
    def generation(self) -> int:
        """Changes whenever a new slab is allocated (the writer process maps each slab once)."""
        return self._generation

    def stage(self, state_dict: STATE_DICT, keys_not_requiring_copy: Collection[str] = ()) -> STATE_DICT:
        sources: list[torch.Tensor] = []
        for key, value in state_dict.items():
            if key not in keys_not_requiring_copy:
                _collect(value, sources)
        self._ensure_slab(tuple((tuple(t.shape), t.dtype) for t in sources))
        views = iter(self._views)
        staged = {
            key: value if key in keys_not_requiring_copy else self._copy(value, views)
            for key, value in state_dict.items()
        }
        if self._non_blocking:
            torch.cuda.current_stream().synchronize()
        self._staged = staged
        return staged

    def get_staged_state_dict(self) -> STATE_DICT | None:
        return self._staged

    def pinned_num_bytes(self) -> int:
        return self._slab.numel() if self._pin and self._slab is not None else 0

    def staged_num_bytes(self) -> int:
        return 0 if self._slab is None else self._slab.numel()

    def close(self) -> None:
        self._release()
        self._staged = None

    def _ensure_slab(self, layout: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> None:
        if layout == self._layout and self._slab is not None:
            return
        offsets, total = [], 0
        for shape, dtype in layout:
            offsets.append(total)
            nbytes = math.prod(shape) * dtype.itemsize
            total += -(-nbytes // _ALIGN) * _ALIGN
        self._release()
        slab = torch.empty(max(total, 1), dtype=torch.uint8)
        if self.config.use_shared_memory:
            slab.share_memory_()
        if self._pin:
            torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 0)
        self._slab, self._layout, self._generation = slab, layout, self._generation + 1
        self._views = [slab_view(slab, SlabRef(o, shape, dtype)) for o, (shape, dtype) in zip(offsets, layout)]

    def _release(self) -> None:
        if self._slab is not None and self._pin:
            torch.cuda.cudart().cudaHostUnregister(self._slab.data_ptr())
        self._slab, self._layout, self._views = None, (), []

    def _copy(self, value: Any, views: Iterator[torch.Tensor]) -> Any:
        def leaf(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return copy.deepcopy(x)
            buf, src = next(views), unwrap_dtensor(x).detach()
            with torch.no_grad():
                buf.copy_(src, non_blocking=self._non_blocking and src.device.type != "cpu")
            return buf

        return _map_leaves(value, leaf)


def _map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    """`value` with containers rebuilt (same type where possible) and `fn` applied to every other leaf."""
    if isinstance(value, Mapping):
        items = {k: _map_leaves(v, fn) for k, v in value.items()}
        return items if type(value) is dict else _rebuild(value, items)
    if isinstance(value, (list, tuple)):
        items_list = [_map_leaves(v, fn) for v in value]
        return type(value)(items_list) if type(value) in (list, tuple) else _rebuild(value, items_list)
    return fn(value)


def _collect(value: Any, out: list[torch.Tensor]) -> None:
    """Tensors in the order `DefaultStager._copy` visits them."""
    if isinstance(value, torch.Tensor):
        out.append(unwrap_dtensor(value))
    elif isinstance(value, Mapping):
        for v in value.values():
            _collect(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)


def slab_view(slab: torch.Tensor, ref: SlabRef) -> torch.Tensor:
    nbytes = math.prod(ref.shape) * ref.dtype.itemsize
    return slab[ref.offset : ref.offset + nbytes].view(ref.dtype).view(ref.shape)


def to_slab_refs(value: Any, slab: torch.Tensor) -> Any:
    """The staged tree with every slab tensor replaced by its SlabRef (containers kept)."""
    base = slab.data_ptr()
    return _map_leaves(
        value, lambda x: SlabRef(x.data_ptr() - base, tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
    )


def from_slab_refs(value: Any, slab: torch.Tensor) -> Any:
    """The tree with each SlabRef turned into a tensor over the slab's memory (no copy).

    Each tensor gets a storage of its own (torch.frombuffer), not a view of the slab's storage: serializers
    write whole storages, so views would put the entire slab, in one dtype, into every item's file.
    """
    memory = memoryview(slab.numpy())

    def own(x: Any) -> Any:
        if not isinstance(x, SlabRef):
            return x
        count = math.prod(x.shape)
        if count == 0:
            return torch.empty(x.shape, dtype=x.dtype)
        flat = torch.frombuffer(memory, dtype=x.dtype, count=count, offset=x.offset)
        return flat.view(x.shape)

    return _map_leaves(value, own)


def _rebuild(original: Any, items: Any) -> Any:
    """Same container type when it can be rebuilt from its items (OrderedDict, namedtuple), else plain."""
    try:
        if isinstance(original, tuple) and hasattr(original, "_fields"):
            return type(original)(*items)
        return type(original)(items)
    except Exception:
        return dict(items) if isinstance(items, dict) else list(items)
