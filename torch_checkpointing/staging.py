"""Staging: the copy of `requires_copy=True` values that lets training go on while a save is written.

Tensors are copied into one host slab that is kept from one save to the next while the state keeps its layout
(shapes and dtypes in traversal order), so a warm save allocates nothing and costs one memory copy. The slab
lives in shared memory so the background writer process maps it once and reads it without another copy; with
CUDA it is also page-locked (cudaHostRegister) so device-to-host copies run non-blocking.
"""

from __future__ import annotations

import copy
import errno
import functools
import io
import math
import mmap
import os
import pickle
import tempfile
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from typing import Any

import torch

from torch_checkpointing.config import CheckpointStagerConfig, check_instance, home_expanded
from torch_checkpointing.memory_advice import MADV_DONTNEED, madvise, populate_write
from torch_checkpointing.pickling import (
    SUB_BYTE_DTYPES,
    found_in,
    found_with_ids,
    raised_by_a_leaf,
    tensors_found_in,
    unpicklable,
)
from torch_checkpointing.signals import start_thread
from torch_checkpointing.traversal import (
    NestingError,
    TreeMemo,
    WholeValues,
    any_leaf,
    distinct_leaves,
    dotted_key,
    freed_storage_said,
    is_dense_data,
    iter_leaves,
    local_tensor,
    map_leaves,
    storage_freed,
)
from torch_checkpointing.types import STATE_DICT

__all__ = [
    "CheckpointStager",
    "CheckpointStagerConfig",
    "DefaultStager",
    "SharedSlab",
    "SlabRef",
    "as_written",
    "tensor_for_write",
    "unwrap_dtensor",
]


_MEMFD_WHERE = "anonymous shared memory"
_DEEP_COPY_FAILS: dict[str, Any] = {
    "doing": "deep-copied for the async save (requires_copy=True)",
    "op": copy.deepcopy,
    "fix": "Async saves copy and pickle every value: make it deep-copyable and picklable, or leave it out of the "
    "checkpoint.",
}
_POPULATE_WORKERS = 4  # threads populating a new slab: page allocation and zeroing scale with cores up to here

unwrap_dtensor = local_tensor  # the published name: a DTensor's local shard, any other value unchanged


def has_lazy_bits(t: torch.Tensor) -> bool:
    """Whether `t` is a lazy conjugate or negative view (x.conj(), x.mH, torch._neg_view): its memory holds
    other values than the tensor, and anything that copies memory as it is (safetensors, a raw buffer) would
    write those."""
    return bool(t.is_conj() or t.is_neg())


def tensor_for_write(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory is exactly the values a checkpoint file must hold for `t`: a DTensor's local
    shard, detached, lazy conjugate/negative bits applied. Every encoder materialises tensors through here."""
    t = local_tensor(t).detach()
    return t.resolve_conj().resolve_neg() if has_lazy_bits(t) else t


def as_written(value: Any) -> Any:
    """`value` with each tensor as a checkpoint file holds it: what the async stager stages, so a sync and an
    async save write the same file. A file therefore holds plain local tensors, never a DTensor (its layout is
    in metadata.json), an `nn.Parameter` or autograd state, and loads in a process without torch.distributed.

    The one storage rule of both modes: leaves that are the same view of the same memory (`alias_of`: tied
    weights, a tensor under two keys) are written once and load back as one tensor; every other tensor is
    written as a storage of its own, so a slice of a larger tensor is written compacted (its elements only,
    contiguous), never with the whole base storage. `value` itself when no tensor needs changing: torch.save
    keeps one tensor per object and shares storages, so two leaves viewing one memory need changing too."""
    if not any_leaf(value, _StorageSeen().needs_writing_form):
        return value
    written: dict[tuple[Any, ...], torch.Tensor] = {}
    first_view: dict[tuple[int, torch.device], tuple[Any, ...]] = {}  # by storage: the alias written over it

    def write(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        alias = alias_of(x)
        if alias is None:
            return _compacted(tensor_for_write(x))
        if alias not in written:
            t = tensor_for_write(x)
            own = first_view.setdefault(_storage_key(local_tensor(x)), alias) == alias
            written[alias] = _compacted(t) if own else t.clone(memory_format=torch.contiguous_format)
        return written[alias]

    return map_leaves(value, write, WholeValues(copy=_copied_or_kept))


def _copied_or_kept(value: Any, memo: TreeMemo) -> Any:
    """A value taken whole that holds a tensor or a container the tree may hold too, copied so that what it
    shares with the rebuilt tree stays shared in the file (as a torch.save of the caller's tree keeps it); any
    other is written as it is, and so is one that cannot be deep-copied, as before (torch.save pickles it: a
    value that does not pickle fails the save there, naming it)."""
    size = len(memo)
    try:
        return _copy_sharing(value, memo, _may_be_in_the_tree)
    except Exception:
        memo.forget_since(size)  # its half-made copies are no other value's
        return value


@dataclass(frozen=True)
class _Convert:
    """What a copy of a value taken whole puts in place of some of the objects it holds (`wants`): `make(x)`."""

    wants: Callable[[Any], bool]
    make: Callable[[Any], Any]

    def into(self, memo: TreeMemo, found: list[Any]) -> None:
        for x in found:
            if self.wants(x) and id(x) not in memo:  # one of the tree's is what the walk made for it
                memo.remember(x, self.make(x))


def _copy_sharing(
    value: Any, memo: TreeMemo, pred: Callable[[Any], bool], convert: _Convert | None = None, *, tree: bool = False
) -> Any:
    """`value` deep-copied through `memo` where it holds something `pred` accepts (with `tree`, also a container
    of the tree), else `value` itself. The copy
    shares with `value` each tensor the tree does not hold: copying its data again cost its size in memory and
    the time to copy it on every save, for nothing (the sync save writes the caller's tensor, as torch.save does;
    a staged item's is the staging's copy already). One that does not pickle is copied whole, the careful way.
    With `convert`, what it wants (and `pred` accepts) is replaced in the copy by what it makes."""
    found, ids = _look(value, pred, tree)
    if found is not None:
        if not any(pred(x) for x in found) and not memo.holds_a_container_of_the_tree(ids):
            return value
        if convert is not None:
            convert.into(memo, found)
        memo.keep(x for x in found if isinstance(x, torch.Tensor))
    return copy.deepcopy(value, memo)


def _look(value: Any, pred: Callable[[Any], bool], tree: bool) -> tuple[list[Any] | None, set[int]]:
    """The tensors and the objects `pred` accepts that `value` holds (None where it does not pickle) and, with
    `tree`, the ids of every container it holds: the tree's are found among them by id, so the look calls no
    Python per dict, list or str (`pred` accepts none of the exact built-in types: a tensor, a SlabRef...)."""
    wanted: Callable[[Any], bool] = lambda x: isinstance(x, torch.Tensor) or pred(x)  # noqa: E731
    if not tree:
        return found_in(value, wanted), set()
    look = found_with_ids(value, wanted)
    return (None, set()) if look is None else look


def _deep_copy_loses(x: Any) -> bool:
    """A tensor inside a value taken whole that the async save cannot deep-copy (sparse compressed, nested, one
    autograd made) or send to the writer as it is (a quantized one arrives without its quantizer), though
    torch.save writes it: it is copied, and sent, as the tree's such tensors are (`_copy_outside_slab`,
    `TensorBytes`)."""
    if not isinstance(x, torch.Tensor) or x.device.type == "meta":
        return False
    return not is_dense_data(x) or x.grad_fn is not None


def _staging_copy(storages: dict[int, torch.UntypedStorage], met: WholeTensors, value: Any, memo: TreeMemo) -> Any:
    """The staging's deep copy of a value taken whole, with each tensor `_deep_copy_loses` copied on its own.
    Its tensors' storages are copied through `storages` (the memo torch's deepcopy keeps them in), which the
    tree's tensors that share one with them are copied through too (`_SlabPlan.shared`). `met` holds the
    tensors the plan found in each such value: one pickling pass per value and save, not two."""
    found = [t for t in met.tensors_in(value) if _deep_copy_loses(t)]
    if found:
        _Convert(_deep_copy_loses, lambda x: _copy_outside_slab(x.detach())).into(memo, found)
    untyped_memo: dict[Any, Any] = memo
    untyped_memo.setdefault("torch", storages)
    return copy.deepcopy(value, memo)


def _storage_shared_copy(t: torch.Tensor, storages: dict[int, torch.UntypedStorage]) -> torch.Tensor:
    """A copy of `t` over the copy of its storage that the staging's deep copies of values taken whole share."""
    storage = t.untyped_storage()
    made = storages.get(storage._cdata)
    if made is None:
        made = storages[storage._cdata] = storage.clone()  # type: ignore[no-untyped-call]
    return torch.empty(0, dtype=t.dtype).set_(made, t.storage_offset(), t.size(), t.stride())


def _may_be_in_the_tree(x: Any) -> bool:
    # Not a plain tuple: pickling makes those (a reduce's arguments), and one of the tree holding no tensor is
    # no tie a load could tell.
    return isinstance(x, torch.Tensor | Mapping | list) or (isinstance(x, tuple) and type(x) is not tuple)


def alias_of(x: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two leaves one tensor in a file: the same memory viewed the same way (None for a tensor
    without strided memory of its own: it is never tied)."""
    t = local_tensor(x)
    if not is_dense_data(t):
        return None
    ptr = t.data_ptr()
    if ptr == 0:
        return None
    return (ptr, t.device, t.dtype, t.shape, t.stride(), t.is_conj(), t.is_neg())


def _is_partial(t: torch.Tensor) -> bool:
    """Whether `t` views its storage other than whole and contiguous (a slice, a transpose): written compacted."""
    return is_dense_data(t) and not _views_whole(t)


def _views_whole(t: torch.Tensor) -> bool:
    """Whether a dense tensor views its storage whole and contiguous."""
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _compacted(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format) if _is_partial(t) else t


def _needs_writing_form(x: Any) -> bool:
    if not isinstance(x, torch.Tensor):
        return False
    return type(x) is not torch.Tensor or x.requires_grad or has_lazy_bits(x) or _is_partial(x)


def _storage_key(t: torch.Tensor) -> tuple[int, torch.device]:
    return t.untyped_storage().data_ptr(), t.device


class _StorageSeen:
    """`needs_writing_form` of a tree's leaves in turn: also true at the second tensor object viewing a storage
    already seen (`w` and `w.detach()`, or `w.view(2, 3)`), which torch.save would write as two tensors over
    one storage where the one storage rule wants one tensor, or two storages. Only a leaf viewing its storage
    whole gets this far (any other is partial), and such views of one storage all start at its first byte: the
    data pointer tells them, without making a storage object per leaf (a pointer met on two devices is a
    needless rebuild, no error)."""

    def __init__(self) -> None:
        self._by_pointer: dict[int, int] = {}  # the id() of the first leaf starting at each address

    def needs_writing_form(self, x: Any) -> bool:
        if not isinstance(x, torch.Tensor):
            return False
        if type(x) is not torch.Tensor or x.requires_grad or has_lazy_bits(x):
            return True
        if not is_dense_data(x):
            return False
        if not _views_whole(x):
            return True
        pointer = x.data_ptr()
        return pointer != 0 and self._by_pointer.setdefault(pointer, id(x)) != id(x)


def _warn_keys_not_requiring_copy() -> None:
    warnings.warn(
        "stage(keys_not_requiring_copy=...) will be removed: the engine never passes it, and which items are "
        "copied is decided by ItemSpec.requires_copy. Stage only the items that need a copy instead.",
        FutureWarning,
        stacklevel=3,
    )


class CheckpointStager(ABC):
    """The interface of the published release's stagers, kept for code written against it: not an extension point.

    The engine's async saver always stages with `DefaultStager` (configured by `CheckpointStagerConfig`); no
    config field or constructor takes another stager, because the writer process reads what `DefaultStager`
    produces (tensors in one shared slab, addressed by `SlabRef`). How `DefaultStager` is called: `stage(items)`
    once per save and once per `prewarm_staging`, with only the items that need a copy, holding the staging lock
    (`CheckpointManager.lock()` waits for it): on its staging thread with `use_async_staging`, else on the
    caller's thread; `close()` once, by the saver's close(). `get_staged_state_dict` and `pinned_num_bytes` are
    never called by the engine.
    """

    @abstractmethod
    def stage(
        self, state_dict: STATE_DICT, keys_not_requiring_copy: Collection[str] = ()
    ) -> STATE_DICT | Future[STATE_DICT]: ...

    def get_staged_state_dict(self) -> STATE_DICT | None:
        """The last staged state, where a stager keeps it; the engine never calls this."""
        return None

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


class SharedSlab:
    """A staging slab in memory shared with the writer process: an mmap (MAP_SHARED) of a memfd, or of an
    unlinked file in `CheckpointStagerConfig.staging_dir`.

    Not torch's share_memory_(): that puts the whole slab in /dev/shm, which containers cap at 64 MiB, and a
    bigger save then dies with "unable to allocate shared memory". The space is reserved up front
    (posix_fallocate), so a directory without room fails at the first save with the fix in the message rather
    than with SIGBUS in the middle of a copy. Pickled, it travels as a duplicate of its descriptor.
    """

    def __init__(self, fd: int, nbytes: int, where: str) -> None:
        self.nbytes, self.where = nbytes, where
        self._fd = fd
        self.tensor = _map_shared(fd, nbytes)

    @classmethod
    def allocate(cls, nbytes: int, directory: str | os.PathLike[str] | None) -> SharedSlab:
        fd, where = _slab_fd(directory)
        try:
            if where != _MEMFD_WHERE:
                _reserve(fd, nbytes, where)  # a file: its blocks, up front
                return cls(fd, nbytes, where)
            _resize(fd, nbytes, where)  # torch's own resize failed as a bare RuntimeError naming /proc/self/fd/N
            slab = cls(fd, nbytes, where)
        except BaseException:
            os.close(fd)
            raise
        try:
            _populate(slab)
        except BaseException:
            slab.tensor = torch.empty(0, dtype=torch.uint8)  # the mapping goes with its last view
            slab.close()
            raise
        return slab

    def close(self) -> None:
        """Give up the descriptor; the memory goes with the last tensor that views it."""
        fd = self.detach_fd()
        if fd >= 0:
            os.close(fd)

    def detach_fd(self) -> int:
        """The descriptor, now the caller's to close (-1 if closed); the slab can no longer be sent."""
        fd, self._fd = self._fd, -1
        return fd

    def __reduce__(self) -> tuple[Any, ...]:
        if self._fd < 0:
            raise ValueError(f"staging slab in {self.where} is closed and cannot be sent to the writer process")
        return (_attach_slab, (DupFd(self._fd), self.nbytes, self.where))


_FREE_WAIT_S = 60.0  # the unmap of a slab takes about a tenth of a second per GiB


def _free_in_background(slab: torch.Tensor, fd: int) -> threading.Thread:
    """Unmap a shared slab and close its descriptor on a daemon thread, instead of on the caller's.

    Dropping a mapped GiB costs the caller about a tenth of a second (page-table teardown, then returning the
    pages), which made `close()` (and a layout change) slow. The thread first drops the page-table entries
    with MADV_DONTNEED through ctypes, which releases the GIL, so the unmap it then does holding the GIL is
    cheap. Safe while other tensors still view the slab: for shared memory, DONTNEED only unmaps; the data
    stays in the memfd and faults back in. The memory goes with the last reference, as before.
    """
    nbytes = slab.numel() * slab.element_size()

    def free(holder: list[torch.Tensor]) -> None:
        madvise(holder[0].data_ptr(), holder[0].data_ptr() + nbytes, MADV_DONTNEED)
        holder.clear()  # the unmap, now of an empty range of page tables
        if fd >= 0:
            os.close(fd)

    thread = threading.Thread(target=free, args=([slab],), name="ckpt-staging-free", daemon=True)
    start_thread(thread)
    return thread


def _map_shared(fd: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the whole descriptor, mapped shared. Through torch's own file mapping where /proc
    names the descriptor, so that the tensor reports `is_shared()` like the /dev/shm slab it replaces."""
    proc = f"/proc/self/fd/{fd}"
    if os.path.exists(proc):
        storage = torch.UntypedStorage.from_file(proc, shared=True, nbytes=nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
    return torch.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED), dtype=torch.uint8)


def _attach_slab(dup: Any, nbytes: int, where: str) -> SharedSlab:
    """The writer process's side: map the received descriptor (the mapping outlives the descriptor)."""
    slab = SharedSlab(dup.detach(), nbytes, where)
    slab.close()
    return slab


def _slab_fd(directory: str | os.PathLike[str] | None) -> tuple[int, str]:
    """A descriptor for a new, empty slab, and where it lives (for messages). A leading `~` in `directory` is
    the home directory, as in every other path the engine takes (it was looked up as a folder named '~')."""
    if directory is None and hasattr(os, "memfd_create"):
        return os.memfd_create("torch_checkpointing-staging", getattr(os, "MFD_CLOEXEC", 0)), _MEMFD_WHERE
    directory = home_expanded(directory) if directory else tempfile.gettempdir()
    try:
        fd, path = tempfile.mkstemp(prefix=".torch_checkpointing-staging-", suffix=".slab", dir=directory)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"Cannot create the async staging slab in {directory} ({exc.strerror}); set "
            f"CheckpointStagerConfig(staging_dir=...) to an existing, writable directory",
            directory,
        ) from exc
    os.unlink(path)  # nothing to clean up after a crash: the descriptors keep the file while they live
    return fd, directory


def _populate(slab: SharedSlab) -> None:
    """Memory for a memfd slab, allocated and mapped up front on every core the process may use (the first
    save's copy would fault each page in on one core: on the benchmark machine 0.7 s a GiB, against 0.4 s on
    two); where the kernel cannot, reserved with posix_fallocate as a file slab is."""
    start = slab.tensor.data_ptr()
    workers = min(_POPULATE_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    try:
        populated = populate_write(start, start + slab.nbytes, workers)
    except OSError as exc:
        raise _no_room(exc, slab.nbytes, slab.where) from exc
    if not populated:
        _reserve(slab._fd, slab.nbytes, slab.where)


def _resize(fd: int, nbytes: int, where: str) -> None:
    try:
        os.ftruncate(fd, nbytes)
    except OSError as exc:  # EFBIG under a file-size limit (`ulimit -f`), which a memfd counts against too
        raise _no_room(exc, nbytes, where) from exc


def _reserve(fd: int, nbytes: int, where: str) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise _no_room(exc, nbytes, where) from exc


def _no_room(exc: OSError, nbytes: int, where: str) -> OSError:
    if exc.errno == errno.EFBIG:
        fix = (
            "The process's file-size limit (`ulimit -f`, RLIMIT_FSIZE) is below that: raise it, or save with "
            "CheckpointManager.Config.with_sync_save(), which stages nothing (its files must fit the limit too)"
        )
    else:
        fix = (
            "Set CheckpointStagerConfig(staging_dir=...) to a directory with room for the whole staged state (or "
            "free memory there), or save with CheckpointManager.Config.with_sync_save(), which stages nothing"
        )
    return OSError(
        exc.errno,
        f"Async staging needs {nbytes} bytes of shared memory for the staged tensors and could not reserve "
        f"them in {where} ({exc.strerror}). {fix}",
        where,
    )


class DefaultStager(CheckpointStager):
    """Copies every tensor of a save into one shared-memory slab, reused while the state keeps its layout.

    One slab (not one buffer per tensor) means one allocation, one page-locking call with CUDA, and one
    file descriptor for the writer process to map, however many tensors the state holds.
    """

    def __init__(self, config: CheckpointStagerConfig | None = None) -> None:
        if config is not None:  # another object was an AttributeError about `use_pinned_memory`
            check_instance("DefaultStager", "config", config, CheckpointStagerConfig, "Pass one, or None for defaults.")
        self.config = config or CheckpointStagerConfig()
        cuda = torch.cuda.is_available()
        self.config.warn_without_cuda()  # quiet where its config (or the one it was copied from) said it
        self._pin = self.config.use_pinned_memory and cuda
        self._non_blocking = self.config.use_non_blocking_copy and cuda
        self._slab: torch.Tensor | None = None
        self._shared: SharedSlab | None = None
        self._layout: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()
        self._views: list[torch.Tensor] = []
        self._generation = 0
        self._staged: STATE_DICT | None = None
        self._freeing: threading.Thread | None = None  # the old slab's unmap, on its own thread
        # Asks the writer process to drop its mapping of the old slab (the async saver sets it): until it does,
        # the old slab's memory stays reserved, and a new one had to find room beside it.
        self.before_new_slab: Callable[[], None] | None = None

    @property
    def slab(self) -> torch.Tensor | None:
        return self._slab

    @property
    def shared_slab(self) -> SharedSlab | torch.Tensor | None:
        """What to send the writer process for the slab: the shared mapping's handle (or the tensor itself
        without use_shared_memory, which torch then moves to shared memory as it pickles it)."""
        return self._shared if self._shared is not None else self._slab

    @property
    def generation(self) -> int:
        """Changes whenever a new slab is allocated (the writer process maps each slab once)."""
        return self._generation

    def stage(self, state_dict: STATE_DICT, keys_not_requiring_copy: Collection[str] = ()) -> STATE_DICT:
        """Copy every item's tensors into the slab; returns the staged state (tensors are slab views).

        `keys_not_requiring_copy` is kept for the published signature: the engine never passes it (it hands
        over only the `requires_copy=True` items), so a non-empty value warns (FutureWarning); those items
        are still returned uncopied.
        """
        if keys_not_requiring_copy:
            _warn_keys_not_requiring_copy()
        plan = _SlabPlan()
        for key, value in state_dict.items():
            if key not in keys_not_requiring_copy:
                plan.add_item(key, value)
        self._ensure_slab(tuple(plan.layout))
        copied: set[int] = set()
        staged = {
            key: value if key in keys_not_requiring_copy else self._copy_item(key, value, plan, copied)
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

    def close(self) -> None:
        self._staged = None  # first: the staged tree views the slab, and _release frees it only when unviewed
        self._release()

    def _ensure_slab(self, layout: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> None:
        if layout == self._layout and self._slab is not None:
            return
        offsets, total = [], 0
        for shape, dtype in layout:
            offsets.append(total)
            nbytes = math.prod(shape) * dtype.itemsize
            total += -(-nbytes // _ALIGN) * _ALIGN
        had_one = self._slab is not None
        self._staged = None  # the last staged tree views the old slab: its memory is free only once unviewed
        self._release()
        if had_one and self.before_new_slab is not None:
            self.before_new_slab()
        if self.config.use_shared_memory:
            self._shared = self._allocate_shared(max(total, 1))
            slab = self._shared.tensor
        else:
            slab = torch.empty(max(total, 1), dtype=torch.uint8)
        if self._pin:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostRegister(slab.data_ptr(), slab.numel(), 0)
        self._slab, self._layout, self._generation = slab, layout, self._generation + 1
        refs = [SlabRef(o, shape, dtype) for o, (shape, dtype) in zip(offsets, layout, strict=True)]
        self._views = [slab_view(slab, ref) for ref in refs]

    def _allocate_shared(self, nbytes: int) -> SharedSlab:
        """A new shared slab; short of room, once more after the old slab's unmap has finished (it runs on its
        own thread, and its memory is free only then: a state whose layout changed failed with ENOSPC in a
        staging directory with room for it, on every later save)."""
        try:
            return SharedSlab.allocate(nbytes, self.config.staging_dir)
        except OSError:
            freeing = self._freeing
            if freeing is None or not freeing.is_alive():
                raise
            freeing.join(_FREE_WAIT_S)
            return SharedSlab.allocate(nbytes, self.config.staging_dir)

    def _release(self) -> None:
        if self._slab is not None and self._pin:
            torch.cuda.cudart().cudaHostUnregister(self._slab.data_ptr())  # type: ignore[no-untyped-call]
        shared, slab = self._shared, self._slab
        self._slab, self._layout, self._views, self._shared = None, (), [], None
        if shared is not None and slab is not None:
            self._freeing = _free_in_background(slab, shared.detach_fd())
        elif shared is not None:
            shared.close()

    def _copy_item(self, key: str, value: Any, plan: _SlabPlan, copied: set[int]) -> Any:
        try:
            return self._copy(value, plan, copied)
        except NestingError as exc:
            raise exc.for_item(key) from None
        except (TypeError, copy.Error, pickle.PicklingError, AttributeError) as exc:  # a deep copy failed
            raise unpicklable(key, value, exc, **_DEEP_COPY_FAILS) from exc
        except Exception as exc:  # a value's own __deepcopy__/__reduce__ may raise anything: named when a leaf does
            named = raised_by_a_leaf(key, value, exc, **_DEEP_COPY_FAILS)
            if named is None:
                raise
            raise named from exc

    def _copy(self, value: Any, plan: _SlabPlan, copied: set[int]) -> Any:
        """The staged tree: each slab tensor copied into its slot once (`_SlabPlan`), tied leaves sharing it; a
        container or other object shared under two paths is copied once, also where one path runs through a
        value taken whole (`map_leaves` with one deepcopy memo), as the sync save's torch.save keeps it one."""

        storages: dict[int, torch.UntypedStorage] = {}
        by_alias: dict[tuple[Any, ...], torch.Tensor] = {}  # tied leaves stay one tensor, as in a slot

        def leaf(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x  # a plain scalar (every other value is deep-copied by `map_leaves`)
            src = tensor_for_write(x)
            if plan.shared(x):
                alias = alias_of(src)
                assert alias is not None  # `_SlabPlan.add_item` shares only tensors that have one
                if alias not in by_alias:
                    by_alias[alias] = _storage_shared_copy(src, storages)
                return by_alias[alias]
            slot = plan.slot_of(x) if fits_slab(src) else None
            if slot is None:
                return _copy_outside_slab(src)
            buf = self._views[slot]
            if slot not in copied:
                copied.add(slot)
                with torch.no_grad():
                    buf.copy_(src, non_blocking=self._non_blocking and src.device.type != "cpu")
            return buf

        copy_whole = functools.partial(_staging_copy, storages, plan.whole_tensors)
        return map_leaves(value, leaf, WholeValues(copy=copy_whole))


class _SlabPlan:
    """Where each slab tensor of a save is staged: one slot per distinct `alias_of` (tied leaves share one, so
    they stay tied and are copied once), laid out in traversal order. Found by the tensor's alias, not by its
    rank in the walk: the copy may meet a tensor first inside a value taken whole. A tensor without one (no
    elements, so no memory) gets no slot. Refuses, before anything is copied, a value no walk can finish and
    a dtype no copy can take."""

    def __init__(self) -> None:
        self.layout: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._slot_of: dict[tuple[Any, ...], int] = {}
        # Every tensor planned, held until the copy, which finds a slot by the memory a tensor views: a planned
        # tensor dropped (one a Mapping made at the access) could give its memory to one made later, which would
        # then take its slot, as if tied to it.
        self._planned: list[torch.Tensor] = []
        self._slot_by_leaf: dict[int, int] = {}  # by id() of a planned leaf (held above): no second `alias_of`
        self._shared: set[int] = set()  # by id() of a planned leaf: see `shared`
        self.whole_tensors = WholeTensors()  # what each value taken whole holds, for the copy as well

    def shared(self, x: torch.Tensor) -> bool:
        """Whether `x` shares its memory with a tensor inside a value taken whole: it is then copied over the
        one copy of that memory the value's copy views, not into the slab, so the file keeps them one storage
        (as a sync save, which writes both from the caller's memory, and torch.save do)."""
        return id(x) in self._shared

    def add_item(self, key: str, value: Any) -> None:
        try:
            leaves = list(distinct_leaves(value))
        except NestingError as exc:
            raise exc.for_item(key) from None
        found = [x for x in leaves if isinstance(x, torch.Tensor)]  # as `_copy` meets them
        self._planned.extend(found)
        in_whole = _storages_in_whole_values(leaves, found, self.whole_tensors)
        for x in found:
            t = local_tensor(x)
            if t.dtype in SUB_BYTE_DTYPES:
                raise _sub_byte_refusal(key, value, t.dtype)
            if t.device.type == "meta" or storage_freed(t):
                refusal = meta_tensor_refusal(key, value, f"Item '{key}' cannot be saved:")
                assert refusal is not None  # `t` is one
                raise refusal
            alias = alias_of(t)
            if in_whole and alias is not None and _written_as_itself(t) and t.untyped_storage().data_ptr() in in_whole:
                self._shared.add(id(x))  # copied with the values taken whole that view its memory, as one storage
                continue
            if fits_slab(t) and alias is not None:
                slot = self._slot_of.setdefault(alias, len(self.layout))
                if slot == len(self.layout):
                    self.layout.append((tuple(t.shape), t.dtype))
                self._slot_by_leaf[id(x)] = slot

    def slot_of(self, x: torch.Tensor) -> int | None:
        """The slot of a tensor leaf planned here; None for one without memory, or one not planned (a Mapping
        made it at this access, in memory of its own): copied on its own."""
        slot = self._slot_by_leaf.get(id(x))
        if slot is not None:
            return slot
        alias = alias_of(x)
        return None if alias is None else self._slot_of.get(alias)


class WholeTensors:
    """The tensors a pickle of each value taken whole meets, found once per value and save: finding them pickles
    the value (a user object's `__reduce__` runs, its arrays are serialised), which the save's blocked time pays
    for, and the plan and the copy both ask."""

    def __init__(self) -> None:
        self._found: dict[int, tuple[Any, list[Any]]] = {}  # id -> (the value, held: its id stays its own)

    def tensors_in(self, value: Any) -> list[Any]:
        held = self._found.get(id(value))
        if held is None or held[0] is not value:
            held = self._found[id(value)] = (value, tensors_found_in(value) or [])
        return held[1]


def _storages_in_whole_values(
    leaves: list[Any], tensors: list[torch.Tensor], met: WholeTensors | None = None
) -> set[int]:
    """The storages (by data pointer) of the dense tensors held inside the values taken whole among `leaves`
    (a tree's) other than the tree's own `tensors`, which the copies share as they are; empty, after one pass
    over the leaves, for a tree holding no value taken whole."""
    wholes = [leaf for leaf in leaves if type(leaf) not in _LEAF_TYPES and not isinstance(leaf, torch.Tensor)]
    if not wholes:
        return set()
    met = WholeTensors() if met is None else met
    tree = {id(t) for t in tensors}
    found: set[int] = set()
    for whole in wholes:
        for t in met.tensors_in(whole):
            if id(t) not in tree and is_dense_data(t) and t.untyped_storage().data_ptr() != 0:
                found.add(t.untyped_storage().data_ptr())
    return found


def _written_as_itself(t: torch.Tensor) -> bool:
    """Whether a tree tensor's file form views its own memory (a sync save writes it from there); host memory
    only, which the staging's copy of it stays in."""
    return fits_slab(t) and t.device.type == "cpu" and not has_lazy_bits(t) and not _is_partial(t)


_LEAF_TYPES = (int, float, bool, str, bytes, type(None))


def _sub_byte_refusal(key: str, value: Any, dtype: torch.dtype) -> pickle.PicklingError:
    path = next(p for p, leaf in iter_leaves(value) if isinstance(leaf, torch.Tensor) and leaf.dtype == dtype)
    where = f"{key}::{dotted_key(path)}" if path else key
    return pickle.PicklingError(
        f"Item '{key}' cannot be staged for the async save: the value at '{where}' is a tensor of dtype {dtype}, "
        f"a sub-byte dtype torch can neither copy nor save (no kernels). Store it packed into torch.uint8 (or "
        f"as a wider integer dtype), or leave it out of the checkpoint."
    )


def meta_tensor_refusal(key: str, value: Any, who: str) -> ValueError | None:
    """The refusal of `value`'s first meta tensor, or tensor whose storage was freed (None without one), as
    every save gives it before writing: a meta tensor has a shape and a dtype but no values, so a checkpoint of
    it would restore nothing; copying a freed one crashed the process (SIGSEGV inside torch). `who` begins the
    message ("TorchSerialization cannot store")."""
    found = next(((p, x) for p, x in iter_leaves(value) if _without_values(x)), None)
    if found is None:
        return None
    path, leaf = found
    where = f"{key}::{dotted_key(path)}" if path else key
    if local_tensor(leaf).is_meta:
        return ValueError(
            f"{who} '{where}': it is a meta tensor (shape {tuple(leaf.shape)}, {leaf.dtype}, no values), so the "
            f"checkpoint would restore nothing. Materialise it first (e.g. module.to_empty(device='cpu') and "
            f"initialise or load it), or leave it out of the save."
        )
    return freed_refusal(who, where, local_tensor(leaf))


def freed_refusal(who: str, where: str, t: torch.Tensor) -> ValueError:
    return ValueError(
        f"{who} '{where}': it is {freed_storage_said(t)}: copying it crashes the process. Save the sharded "
        f"state (model.state_dict() outside forward/backward), or leave it out of the save."
    )


def _without_values(x: Any) -> bool:
    if not isinstance(x, torch.Tensor):
        return False
    t = local_tensor(x)
    return t.is_meta or storage_freed(t)


def fits_slab(t: torch.Tensor) -> bool:
    """Whether a tensor is staged into the slab: a plain tensor (no subclass) of dense data (`is_dense_data`).

    Sparse, quantized, nested and meta tensors cannot be `copy_()`-ed into a flat byte buffer and rebuilt from
    an offset, and a tensor subclass rebuilt from one is a plain tensor; they are copied on their own
    (`_copy_outside_slab`) and travel to the writer pickled, so an async save writes what a sync save writes."""
    return type(t) in _PLAIN_TENSOR_TYPES and is_dense_data(t)


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _copy_outside_slab(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a tensor the slab cannot hold (see `fits_slab`)."""
    with torch.no_grad():
        return t.clone() if t.device.type in ("cpu", "meta") else t.to("cpu", copy=True)


def slab_view(slab: torch.Tensor, ref: SlabRef) -> torch.Tensor:
    nbytes = math.prod(ref.shape) * ref.dtype.itemsize
    return slab[ref.offset : ref.offset + nbytes].view(ref.dtype).view(ref.shape)


@dataclass(frozen=True)
class TensorBytes:
    """A staged tensor the slab cannot hold (see `fits_slab`), on its way to the writer by value.

    Shared-memory handles (torch.multiprocessing's reductions) carry a tensor's storage and lose the rest: a
    quantized tensor arrives without its quantizer. `torch.save` bytes carry all of it.
    """

    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorBytes:
        buf = io.BytesIO()
        torch.save(tensor, buf)
        return cls(buf.getvalue())

    def tensor(self) -> torch.Tensor:
        # Bytes the trainer made from its own value for this save, never a file: read with the full unpickler,
        # which rebuilds what the safe one refuses (a tensor subclass, a jagged nested tensor) as torch.save
        # wrote it. A file holding such a value is refused or allowed by the load's own rules.
        value = torch.load(io.BytesIO(self.data), weights_only=False)
        assert isinstance(value, torch.Tensor)
        return value


def to_slab_refs(value: Any, slab: torch.Tensor) -> Any:
    """The staged tree as it travels to the writer: each slab tensor replaced by its SlabRef, each other tensor
    by its TensorBytes (containers and other leaves kept)."""
    base, storage = slab.data_ptr(), slab.untyped_storage().data_ptr()
    in_whole: list[set[int]] = []  # found when first asked: most trees hold no tensor off the slab

    def viewed_from_a_whole_value(x: torch.Tensor) -> bool:
        if not in_whole:
            leaves = list(distinct_leaves(value))
            in_whole.append(_storages_in_whole_values(leaves, [t for t in leaves if isinstance(t, torch.Tensor)]))
        return x.untyped_storage().data_ptr() in in_whole[0]

    def ref(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if fits_slab(x) and x.untyped_storage().data_ptr() == storage:
            return SlabRef(x.data_ptr() - base, tuple(x.shape), x.dtype)
        if type(x) is torch.Tensor and is_dense_data(x) and viewed_from_a_whole_value(x):
            return x  # its memory is viewed from a value taken whole too: sent with it, one storage in one pickle
        return TensorBytes.of(x)

    def held(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and fits_slab(x) and x.untyped_storage().data_ptr() == storage

    # A staged tensor inside a value taken whole (the staging copy put it there) travels as its ref too, and one
    # the pipe would not carry whole (a quantized one loses its quantizer) as its bytes.
    as_bytes = _Convert(_deep_copy_loses, TensorBytes.of)
    copy_whole = _copy_where(lambda x: held(x) or _deep_copy_loses(x), as_bytes)
    return map_leaves(value, ref, WholeValues(copy=copy_whole))


def _copy_where(pred: Callable[[Any], bool], convert: _Convert | None = None) -> Callable[[Any, TreeMemo], Any]:
    """Copy a value taken whole only where it holds something `pred` accepts or a container of the tree, sharing
    its other tensors (`_copy_sharing`): the rest is sent as it is, since a second deep copy of each, after the
    staging copy's, was work and memory for nothing. A container of the tree is rebuilt by the walk: a value
    holding one sent as it was held the old one, and the file had two lists where the trainer had one."""

    def copy_if_holding(value: Any, memo: TreeMemo) -> Any:
        return _copy_sharing(value, memo, pred, convert, tree=True)

    return copy_if_holding


def from_slab_refs(value: Any, slab: torch.Tensor | SharedSlab) -> Any:
    """The tree with each SlabRef turned into a tensor over the slab's memory (no copy).

    Each tensor gets a storage of its own (torch.frombuffer), not a view of the slab's storage: serializers
    write whole storages, so views would put the entire slab, in one dtype, into every item's file.
    One SlabRef met twice (tied leaves staged once) gives one tensor, so the file keeps them tied.
    """
    memory = (slab.tensor if isinstance(slab, SharedSlab) else slab).numpy().data
    made: dict[SlabRef, torch.Tensor] = {}

    def own(x: Any) -> Any:
        if isinstance(x, TensorBytes):
            return x.tensor()
        if not isinstance(x, SlabRef):
            return x
        if math.prod(x.shape) == 0:  # no memory, so never tied (empty slots share offsets)
            return torch.empty(x.shape, dtype=x.dtype)
        if x not in made:
            made[x] = _over_slab(memory, x)
        return made[x]

    refs = (SlabRef, TensorBytes)
    from_bytes = _Convert(lambda x: isinstance(x, TensorBytes), TensorBytes.tensor)
    copy_whole = _copy_where(lambda x: isinstance(x, refs), from_bytes)
    return map_leaves(value, own, WholeValues(copy_whole, mapped=refs))


def _over_slab(memory: memoryview, ref: SlabRef) -> torch.Tensor:
    return torch.frombuffer(memory, dtype=ref.dtype, count=math.prod(ref.shape), offset=ref.offset).view(ref.shape)
