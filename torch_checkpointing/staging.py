"""Staging: the copy of `requires_copy=True` values that lets training go on while a save is written.

Tensors are copied into host buffers that are kept from one save to the next (keyed by item and nested path),
so a warm save allocates nothing and costs one memory copy. Buffers live in shared memory so the background
writer process reads them without another copy; with CUDA they are also page-locked (cudaHostRegister) so
device-to-host copies run non-blocking.
"""

from __future__ import annotations

import copy
import warnings
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_checkpointing.types import STATE_DICT, NestedPath

__all__ = ["CheckpointStager", "CheckpointStagerConfig", "DefaultStager", "unwrap_dtensor"]


def _cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclass
class CheckpointStagerConfig:
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


class DefaultStager(CheckpointStager):
    def __init__(self, config: CheckpointStagerConfig | None = None) -> None:
        self.config = config or CheckpointStagerConfig()
        cuda = torch.cuda.is_available()
        if (self.config.use_pinned_memory or self.config.use_non_blocking_copy) and not cuda:
            warnings.warn("CheckpointStagerConfig asks for pinned memory / non-blocking copies but CUDA is not "
                          "available; staging uses plain host memory.", stacklevel=2)
        self._pin = self.config.use_pinned_memory and cuda
        self._non_blocking = self.config.use_non_blocking_copy and cuda
        self._pool: dict[tuple[str, NestedPath], torch.Tensor] = {}
        self._used: set[tuple[str, NestedPath]] = set()
        self._pinned_bytes = 0
        self._staged: STATE_DICT | None = None

    def stage(self, state_dict: STATE_DICT, keys_not_requiring_copy: Collection[str] = ()) -> STATE_DICT:
        self._used = set()
        staged = {
            key: value if key in keys_not_requiring_copy else self._copy(key, (), value)
            for key, value in state_dict.items()
        }
        if self._non_blocking:
            torch.cuda.current_stream().synchronize()
        for stale in set(self._pool) - self._used:
            self._release(self._pool.pop(stale))
        self._staged = staged
        return staged

    def get_staged_state_dict(self) -> STATE_DICT | None:
        return self._staged

    def pinned_num_bytes(self) -> int:
        return self._pinned_bytes

    def staged_num_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._pool.values())

    def close(self) -> None:
        for buf in self._pool.values():
            self._release(buf)
        self._pool.clear()
        self._staged = None

    def _copy(self, key: str, path: NestedPath, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(key, path, unwrap_dtensor(value))
        if isinstance(value, Mapping):
            items = {k: self._copy(key, (*path, k), v) for k, v in value.items()}
            return items if type(value) is dict else _rebuild(value, items)
        if isinstance(value, (list, tuple)):
            items_list = [self._copy(key, (*path, i), v) for i, v in enumerate(value)]
            if type(value) in (list, tuple):
                return type(value)(items_list)
            return _rebuild(value, items_list)
        return copy.deepcopy(value)

    def _copy_tensor(self, key: str, path: NestedPath, src: torch.Tensor) -> torch.Tensor:
        slot = (key, path)
        self._used.add(slot)
        buf = self._pool.get(slot)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            if buf is not None:
                self._release(buf)
            buf = self._allocate(src)
            self._pool[slot] = buf
        with torch.no_grad():
            buf.copy_(src.detach(), non_blocking=self._non_blocking and src.device.type != "cpu")
        return buf

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu")
        if self.config.use_shared_memory:
            buf.share_memory_()
        if self._pin and buf.numel():
            nbytes = buf.untyped_storage().nbytes()
            torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            self._pinned_bytes += nbytes
        return buf

    def _release(self, buf: torch.Tensor) -> None:
        if self._pin and buf.numel():
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            self._pinned_bytes -= buf.untyped_storage().nbytes()


def _rebuild(original: Any, items: Any) -> Any:
    """Same container type when it can be rebuilt from its items (OrderedDict, namedtuple), else plain."""
    try:
        if isinstance(original, tuple) and hasattr(original, "_fields"):
            return type(original)(*items)
        return type(original)(items)
    except Exception:
        return dict(items) if isinstance(items, dict) else list(items)
