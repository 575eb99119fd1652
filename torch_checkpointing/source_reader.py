"""Read blocks of the tensors a source rank saved, touching only the bytes a load plan needs.

Torch files are opened with `torch.load(mmap=True, weights_only=True)` so slicing a tensor pages in
only that slice; safetensors files are opened with `safe_open(...).get_slice`, or, when the storage
has no local path, read with byte-range requests computed from the safetensors header. A storage
without local paths holding a Torch file is read whole (the zip container offers no cheaper route).

Through a load's verifying storage view a mapped file is checked by byte range, never whole: everything the
library reads itself (the zip directory, the pickle, the safetensors header) is checked before it is opened,
and each block read checks the byte range it covers (`Storage.verify_range`) before it is returned.
"""

from __future__ import annotations

import io
import logging
import math
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torch_checkpointing.checkpoint_layout import SerializationFormat
from torch_checkpointing.codecs import (
    MAX_SAFETENSORS_HEADER,
    RESHARDING_LOAD,
    SAFETENSORS_DTYPES,
    SourcePurpose,
    codec_for,
    dense_tensors,
    load_resharding_source,
    mapped_base,
    parse_safetensors_header,
    records_naming,
    safetensors_dtype,
)
from torch_checkpointing.errors import (
    DECODE_ERRORS,
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    on_another,
    raise_if_short_of_resources,
    undecodable,
)
from torch_checkpointing.memory_advice import MADV_RANDOM, MADV_WILLNEED, madvise
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.traversal import dotted_key, flatten, get_path, local_tensor
from torch_checkpointing.types import NestedPath
from torch_checkpointing.walk_utils import MISSING

logger = logging.getLogger("torch_checkpointing.source_reader")
__all__ = [
    "SAFETENSORS_DTYPES",
    "FlatTensors",
    "ReadStats",
    "SourceFile",
    "SourceTensor",
    "dotted_key",
    "open_flat_tensors",
    "open_safetensors_source",
    "open_source_file",
    "open_torch_source",
]


@dataclass
class ReadStats:
    """What a load touched: lets tests (and users) check a rank reads only what it needs."""

    files_opened: list[str] = field(default_factory=list)
    blocks_read: int = 0
    bytes_read: int = 0


def _block_index(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


class SourceTensor(ABC):
    """One saved local tensor, readable block by block."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    # True where each read is a request to a store (ranged GETs), which can fail or meet another object at any
    # time; False where blocks are views of a file already open (memory-mapped, or read whole).
    reads_on_demand: bool = False

    @abstractmethod
    def _read(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor: ...

    def read_block(self, offsets: tuple[int, ...], sizes: tuple[int, ...], stats: ReadStats) -> torch.Tensor:
        if not len(offsets) == len(sizes) == len(self.shape):
            raise ValueError(f"Block of rank {len(offsets)} for a saved tensor of shape {self.shape}")
        for o, s, n in zip(offsets, sizes, self.shape, strict=True):
            if o < 0 or o + s > n:
                raise ValueError(f"Block offsets={offsets} sizes={sizes} lies outside the saved shape {self.shape}")
        block = self._read(tuple(offsets), tuple(sizes))
        stats.blocks_read += 1
        return block

    def check_block(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:  # noqa: B027 - a no-op here
        """Check the block's bytes against the checkpoint's checksums without reading it out (a check phase
        that wants damage found before the first copy); a no-op where the storage records none."""


class _InMemoryTensor(SourceTensor):
    def __init__(self, tensor: torch.Tensor, stats: ReadStats, mapping: _FileMapping | None = None) -> None:
        self._t = tensor
        self._stats = stats
        self._mapping = mapping
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype

    def check_block(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        block = self._t[_block_index(offsets, sizes)]
        if self._mapping is not None and block.numel():
            self._mapping.verify(*_address_range(self._t, block))

    def _read(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        block = self._t[_block_index(offsets, sizes)]
        self._stats.bytes_read += block.numel() * block.element_size()
        if self._mapping is not None and block.numel():
            read = self._mapping.read(*_address_range(self._t, block))
            if read is not None:
                return torch.frombuffer(read, dtype=block.dtype).as_strided(block.shape, block.stride(), 0)
        self.check_block(offsets, sizes)
        _advise_exact_read(self._t, block)
        return block


def _address_range(source: torch.Tensor, block: torch.Tensor) -> tuple[int, int]:
    """The memory addresses [begin, end) bounding a (possibly strided) block of `source`'s storage."""
    storage = source.untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    elem = block.element_size()
    last = block.storage_offset() + sum((n - 1) * st for n, st in zip(block.shape, block.stride(), strict=True))
    begin = base + block.storage_offset() * elem
    return int(begin), int(min(base + (last + 1) * elem, base + nbytes))


def _advise_exact_read(source: torch.Tensor, block: torch.Tensor) -> None:
    """Page in exactly the block's byte range of a memory-mapped source, without the kernel's readahead.

    Faults on a file mapping read ahead (often megabytes): a rank needing half of a small tensor would read
    all of it. MADV_RANDOM stops that; MADV_WILLNEED then fetches the block's bounding range in large I/O.
    Harmless on anonymous memory.
    """
    if block.numel() == 0 or source.device.type != "cpu":
        return
    storage = source.untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    madvise(base, base + nbytes, MADV_RANDOM)
    madvise(*_address_range(source, block), MADV_WILLNEED)


@dataclass
class _FileMapping:
    """Where torch mapped a source file in memory, so a block's addresses name its bytes in the file."""

    verify_range: Callable[[int, int], None]
    base: int  # the address of the file's byte 0
    size: int
    read_range: Callable[[int, int], bytes] | None = None

    def read(self, begin: int, end: int) -> bytearray | None:
        """The checked bytes of the file at addresses [begin, end) of its mapping, read from the file (None where
        the addresses are not known to be this file's): a block handed out as a view of the mapping was checked
        before it was copied, not as it was copied, so a file written into meanwhile gave unchecked bytes, and
        one truncated meanwhile killed the process with SIGBUS at the copy."""
        offset = begin - self.base
        if self.read_range is None or offset < 0 or end - self.base > self.size:
            return None
        return bytearray(self.read_range(offset, end - begin))

    def verify(self, begin: int, end: int) -> None:
        offset = begin - self.base
        if offset < 0 or end - self.base > self.size:  # not from this file's mapping: check all of it
            self.verify_range(0, self.size)
            return
        self.verify_range(offset, end - begin)


class SourceFile(ABC):
    """One source rank's file for one item."""

    @abstractmethod
    def tensor(self, path: NestedPath) -> SourceTensor | None:
        """The saved local tensor at `path`, or None when the file has no tensor there."""

    @abstractmethod
    def keys(self) -> list[str]:
        """Dotted keys of every tensor in the file."""

    def entry(self, path: NestedPath) -> Any:
        """The saved value at `path` (any value, tensors included), or `MISSING`; formats that hold tensors
        only have no other values, so by default every path is missing."""
        return MISSING


class _EmptySourceFile(SourceFile):
    """JSON and raw files hold no tensors: every path reads as absent."""

    def tensor(self, path: NestedPath) -> SourceTensor | None:
        return None

    def keys(self) -> list[str]:
        return []


def _tensors(value: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a Torch file's value under its dotted key, DTensors as their local shards."""
    return flatten(value, keep=lambda leaf: isinstance(leaf, torch.Tensor))


class _TorchSourceFile(SourceFile):
    def __init__(
        self, value: Any, stats: ReadStats, path: Path, operation: str, mapping: _FileMapping | None = None
    ) -> None:
        self._value = value
        self._stats = stats
        self._path = path
        self._operation = operation  # the read context's, whose fix a refusal names
        self._mapping = mapping

    def tensor(self, path: NestedPath) -> SourceTensor | None:
        node = local_tensor(get_path(self._value, path))
        return self.block_source(node, dotted_key(path)) if isinstance(node, torch.Tensor) else None

    def block_source(self, tensor: torch.Tensor, name: str) -> SourceTensor:
        """`tensor` (of this file, at dotted key `name`) for block reads: refused unless it is a dense tensor with
        values. A meta, sparse or nested tensor cannot be sliced and copied (torch raised its own bare error,
        for a meta tensor only in the copy, after other entries were filled)."""
        kind = "meta" if tensor.device.type == "meta" else "nested" if tensor.is_nested else None
        if kind is None and tensor.layout != torch.strided:
            kind = f"sparse ({tensor.layout})"
        if kind is not None:
            raise CorruptCheckpointError(
                f"{self._path} holds tensor {name!r} as a {kind} tensor, which has no dense values to read block by "
                f"block; its sharding metadata records a dense one. The checkpoint is damaged or crafted. "
                f"{on_another(self._operation)}"
            )
        return _InMemoryTensor(tensor, self._stats, self._mapping)

    def keys(self) -> list[str]:
        return list(_tensors(self._value))

    def entry(self, path: NestedPath) -> Any:
        return get_path(self._value, path, MISSING)


def open_torch_source(
    storage: Storage, path: Path, stats: ReadStats, purpose: SourcePurpose = RESHARDING_LOAD
) -> SourceFile:
    """A Torch file for block reads: memory-mapped where the storage maps files, each block's bytes checked
    before use (through a verifying view); else read whole. Every mapped tensor is checked to lie inside its
    own record of the file (`codecs.check_storages_fit`, the check every Torch decode runs)."""
    mapped = storage.mapped_path(path)
    if mapped is None:
        return _TorchSourceFile(load_resharding_source(storage, path, purpose=purpose), stats, path, purpose.by)
    if not _checks_reads(storage):  # a plain store records nothing to check: map it, as torch does
        return _TorchSourceFile(load_resharding_source(storage, path, mapped, purpose=purpose), stats, path, purpose.by)
    size = storage.getsize(path)
    records = records_naming(path, _RangeFile(storage, path, size), purpose.by)  # the zip directory, checked
    if records is None:
        storage.verify_range(path, 0, size)  # not a zip (legacy torch.save): torch reads all of it
    else:
        _verify_outside(storage, path, size, records)
    value = load_resharding_source(storage, path, mapped, records, purpose)
    return _TorchSourceFile(
        value, stats, path, purpose.by, _mapping_of(storage, path, mapped, size, value, records or {})
    )


def _verify_outside(storage: Storage, path: Path, size: int, records: dict[int, int]) -> None:
    """Check every byte of a Torch zip file except the tensor payloads (torch reads them itself, unchecked):
    the zip directory, each record's header, the pickle."""
    at = 0
    for start, length in sorted(records.items()):
        if start > at:
            storage.verify_range(path, at, start - at)
        at = max(at, start + length)
    if at < size:
        storage.verify_range(path, at, size - at)


class _RangeFile(io.RawIOBase):
    """A read-only file over `Storage.read_range` (checked reads through a verifying view), for `zipfile`."""

    def __init__(self, storage: Storage, path: Path, size: int) -> None:
        super().__init__()
        self._storage, self._path, self._size, self._pos = storage, path, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, offset + (0, self._pos, self._size)[whence])
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        if end <= self._pos:
            return b""
        data = self._storage.read_range(self._path, self._pos, end - self._pos)
        self._pos = end
        return data


def _mapping_of(
    storage: Storage, path: Path, mapped: str, size: int, value: Any, records: Mapping[int, int]
) -> _FileMapping:
    """Where torch mapped the file: the kernel names the file's byte 0 (found by the file's device and inode,
    starting from its `records`' offsets). Without it (no /proc) every block read checks the whole file, once."""
    check: Callable[[int, int], None] = lambda offset, length: storage.verify_range(path, offset, length)  # noqa: E731
    read: Callable[[int, int], bytes] = lambda offset, length: storage.read_range(path, offset, length)  # noqa: E731
    base = mapped_base(dense_tensors(value).values(), mapped, records)
    return _FileMapping(check, base if base is not None else -(1 << 62), size, read)


class _SafetensorsLocalTensor(SourceTensor):
    def __init__(
        self, handle: Any, key: str, stats: ReadStats, check: Callable[[int, int], None] | None = None, begin: int = 0
    ) -> None:
        self._handle = handle
        self._key = key
        self._stats = stats
        self._check = check
        self._begin = begin
        sl = handle.get_slice(key)
        self.shape = tuple(sl.get_shape())
        self.dtype = safetensors_dtype(sl.get_dtype(), f"tensor {key!r}")

    def check_block(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        if self._check is not None and all(sizes):
            first, length = _bounding_range(self.shape, self.dtype, offsets, sizes)
            self._check(self._begin + first, length)

    def _read(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        block: torch.Tensor
        self.check_block(offsets, sizes)
        if not offsets:
            block = self._handle.get_tensor(self._key)
        else:
            block = self._handle.get_slice(self._key)[_block_index(offsets, sizes)]
        self._stats.bytes_read += block.numel() * block.element_size()
        return block


class _SafetensorsLocalFile(SourceFile):
    def __init__(self, local: str, stats: ReadStats, checked: tuple[Storage, Path] | None = None) -> None:
        from safetensors import safe_open

        self._begins: dict[str, int] = {}
        self._check: Callable[[int, int], None] | None = None
        if checked is not None:  # through a verifying view: the header is checked before safetensors reads it
            storage, path = checked
            entries, base = _read_safetensors_header(storage, path)
            self._begins = {k: base + int(e["data_offsets"][0]) for k, e in entries.items()}
            self._check = lambda offset, length: storage.verify_range(path, offset, length)
        self._handle = safe_open(local, framework="pt", device="cpu")
        self._keys = set(self._handle.keys())  # type: ignore[no-untyped-call]
        self._stats = stats

    def tensor(self, path: NestedPath) -> SourceTensor | None:
        key = dotted_key(path)
        if key not in self._keys:
            return None
        return _SafetensorsLocalTensor(self._handle, key, self._stats, self._check, self._begins.get(key, 0))

    def keys(self) -> list[str]:
        return sorted(self._keys)


class _SafetensorsRangeTensor(SourceTensor):
    """Reads the smallest byte range holding a block (row-major bounding range) through `read_range`."""

    reads_on_demand = True

    def __init__(self, storage: Storage, path: Path, base: int, entry: dict[str, Any], stats: ReadStats) -> None:
        self._storage = storage
        self._path = path
        self._begin = base + int(entry["data_offsets"][0])
        self._stats = stats
        self.shape = tuple(int(n) for n in entry["shape"])
        self.dtype = safetensors_dtype(entry.get("dtype"), path)

    def check_block(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        if all(sizes):
            first, length = _bounding_range(self.shape, self.dtype, offsets, sizes)
            self._storage.verify_range(self._path, self._begin + first, length)

    def _read(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        if any(s == 0 for s in sizes):
            return torch.empty(sizes, dtype=self.dtype)
        first, length = _bounding_range(self.shape, self.dtype, offsets, sizes)
        data = bytearray(self._storage.read_range(self._path, self._begin + first, length))
        self._stats.bytes_read += length
        flat = torch.frombuffer(data, dtype=self.dtype)
        return flat.as_strided(sizes, _row_major_strides(self.shape), 0)


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def _bounding_range(
    shape: tuple[int, ...], dtype: torch.dtype, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[int, int]:
    """(byte offset from the tensor's start, length) of the smallest row-major range holding a non-empty block."""
    strides = _row_major_strides(shape)
    first = sum(o * st for o, st in zip(offsets, strides, strict=True))
    last = sum((o + s - 1) * st for o, s, st in zip(offsets, sizes, strides, strict=True))
    elem = dtype.itemsize
    return first * elem, (last - first + 1) * elem


def _read_safetensors_header(storage: Storage, path: Path) -> tuple[dict[str, Any], int]:
    """(tensor entries, byte offset of the data = bytes read) of a safetensors file, via ranged reads.

    The header is untrusted (an unverified load, or a checkpoint whose manifest was rewritten with it): its
    length is bounded by the file before it is read, and every entry is checked to lie inside the file.
    """
    size = storage.getsize(path)
    if size < 8:
        raise CorruptCheckpointError(f"{path} has {size} bytes: too short for a safetensors file.")
    (header_len,) = struct.unpack("<Q", storage.read_range(path, 0, 8))
    if header_len > min(size - 8, MAX_SAFETENSORS_HEADER):
        raise CorruptCheckpointError(f"{path}: its safetensors header claims {header_len} bytes of a {size}-byte file.")
    header = parse_safetensors_header(path, storage.read_range(path, 8, header_len))
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: its safetensors header is not a JSON object.")
    _check_metadata(path, header.pop("__metadata__", None))
    for name, entry in header.items():
        _check_entry(path, name, entry, size - 8 - header_len)
    _check_tiling(path, header, size - 8 - header_len)
    return header, 8 + header_len


def _check_metadata(path: Path, metadata: Any) -> None:
    """`__metadata__`, as the library reads it: absent, or an object of strings."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(f"{path}: its safetensors '__metadata__' is not an object of strings.")


def _check_tiling(path: Path, entries: dict[str, Any], data_size: int) -> None:
    """The library's rule, which a local load of the same file applies: the tensors, in offset order, cover the
    data exactly, each starting where the one before ends. Checked alone, entries could overlap (two names read
    as one tensor's bytes), leave a gap or stop short of the end: a file refused on local disk, loaded from S3."""
    end = 0
    for name, entry in sorted(entries.items(), key=lambda e: (e[1]["data_offsets"][0], e[1]["data_offsets"][1])):
        begin, stop = entry["data_offsets"]
        if begin != end:
            raise CorruptCheckpointError(
                f"{path}: safetensors entry {name!r} starts at data byte {begin}, not {end} where the tensor before "
                f"it ends: its tensors overlap or leave a gap. The file is damaged or crafted."
            )
        end = stop
    if end != data_size:
        raise CorruptCheckpointError(
            f"{path}: its safetensors tensors end at data byte {end}, but the file holds {data_size} data bytes: "
            f"bytes no tensor covers. The file is damaged or crafted."
        )


def _check_entry(path: Path, name: str, entry: Any, data_size: int) -> None:
    """One header entry: a known dtype, a shape of non-negative ints, offsets inside the data that hold it."""
    what = f"{path}: safetensors entry {name!r}"
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{what} is not an object.")
    dtype = safetensors_dtype(entry.get("dtype"), what)
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise CorruptCheckpointError(f"{what} has no valid 'shape' ({shape!r}).")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)):
        raise CorruptCheckpointError(f"{what} has no valid 'data_offsets' ({offsets!r}).")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * dtype.itemsize:
        raise CorruptCheckpointError(
            f"{what}: data_offsets {offsets} do not hold a {tuple(shape)} {dtype} tensor inside the file's "
            f"{data_size} data bytes."
        )


class _SafetensorsRangeFile(SourceFile):
    def __init__(self, storage: Storage, path: Path, stats: ReadStats) -> None:
        header, base = _read_safetensors_header(storage, path)
        stats.bytes_read += base
        self._entries = header
        self._base = base
        self._storage = storage
        self._path = path
        self._stats = stats

    def tensor(self, path: NestedPath) -> SourceTensor | None:
        entry = self._entries.get(dotted_key(path))
        if entry is None:
            return None
        return _SafetensorsRangeTensor(self._storage, self._path, self._base, entry, self._stats)

    def keys(self) -> list[str]:
        return sorted(self._entries)


def open_source_file(
    storage: Storage,
    path: Path,
    fmt: SerializationFormat,
    stats: ReadStats,
    purpose: SourcePurpose = RESHARDING_LOAD,
) -> SourceFile:
    """Open one source rank's item file for block reads, for `purpose` (which its refusals name); nothing is
    read eagerly beyond headers."""
    if not storage.exists(path):
        raise FileNotFoundError(f"Source file {path} named by the checkpoint's sharding metadata does not exist")
    stats.files_opened.append(str(path))
    try:
        return codec_for(fmt).open_source(fmt, storage, path, stats, purpose=purpose)
    except (CheckpointError, ConfigError):
        raise
    except DECODE_ERRORS as exc:
        raise_if_short_of_resources(exc, path, purpose.operation)
        raise undecodable(path, purpose.operation, exc, purpose.by) from exc


def open_safetensors_source(storage: Storage, path: Path, stats: ReadStats) -> SourceFile:
    """A safetensors file for block reads: mapped where the storage maps files (each block's bytes checked
    before use, through a verifying view), else read with ranged reads computed from its header."""
    mapped = storage.mapped_path(path)
    if mapped is not None:
        return _SafetensorsLocalFile(mapped, stats, (storage, path) if _checks_reads(storage) else None)
    return _SafetensorsRangeFile(storage, path, stats)


def _checks_reads(storage: Storage) -> bool:
    """Whether `verify_range` does anything (a load's verifying view); on a plain store it is a no-op, and the
    work done only to call it (walking a zip's records, finding a mapping, parsing headers twice) is skipped."""
    return type(storage).verify_range is not Storage.verify_range


class FlatTensors(Mapping[str, torch.Tensor]):
    """Every tensor of a file under its dotted key; a tensor's bytes are read only when it is accessed."""

    def __init__(self, source: SourceFile) -> None:
        self._source = source
        self._keys = source.keys()  # the file's order, for iteration
        self._known = frozenset(self._keys)  # membership: a list made every lookup scan all keys
        self._stats = ReadStats()
        self._torch_flat: dict[str, torch.Tensor] | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        """The whole tensor, read as a block: its bytes are checked against the checkpoint's block checksums
        (a Torch file's tensor is a view of its mapping, which nothing checked before it is handed out)."""
        handle = self._handle(key)
        return handle.read_block((0,) * len(handle.shape), handle.shape, self._stats)

    def describe(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of a tensor without reading its bytes (a torch file's tensors are mapped views)."""
        handle = self._handle(key)
        return tuple(handle.shape), handle.dtype

    def _handle(self, key: str) -> SourceTensor:
        if key not in self._known:
            raise KeyError(key)
        if isinstance(self._source, _TorchSourceFile):
            if self._torch_flat is None:  # mmap-backed views: flattening reads no tensor data
                self._torch_flat = _tensors(self._source._value)
            return self._source.block_source(self._torch_flat[key], key)
        handle = self._source.tensor((key,))  # one component: its dotted key is `key` itself
        if handle is None:
            raise KeyError(key)
        return handle

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def open_flat_tensors(storage: Storage, path: Path, fmt: SerializationFormat) -> FlatTensors:
    """Every tensor of a file under its dotted key (DTensors unwrapped), materialised only when accessed."""
    return FlatTensors(open_source_file(storage, path, fmt, ReadStats()))
