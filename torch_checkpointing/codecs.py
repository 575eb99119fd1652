"""One codec per serialization format: how an item value is encoded to its file, decoded back, and opened as a
resharding source. The registry is keyed by format type; nothing else in the engine branches on the format.

A new format is a `SerializationFormat` declaration in `checkpoint_layout.py` plus a `Codec` here, registered in
`CODECS`. The sync writer, the background writer process, the loader, the resharders and the exporters all
reach the format through `codec_for`.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import io
import json
import logging
import mmap
import os
import pickle
import pickletools
import re
import struct
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    RawSerialization,
    SafetensorsSerialization,
    SerializationFormat,
    TorchSerialization,
)
from torch_checkpointing.errors import (
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    CorruptCheckpointError,
    RefusedPickleError,
    TemplateMismatchError,
    on_another,
    raise_if_short_of_resources,
    undecodable,
    unknown_to_this_engine,
)
from torch_checkpointing.json_dataclass import RebuildGaps, from_jsonable, to_jsonable
from torch_checkpointing.manifest import DuplicateKeyError, unique_keys
from torch_checkpointing.pickling import raised_by_a_leaf, unpicklable
from torch_checkpointing.safetensors_tree import flatten_tensors, named_leaves, unflatten_to_target
from torch_checkpointing.staging import as_written, meta_tensor_refusal
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.traversal import (
    NestingError,
    children,
    flatten,
    is_container,
    join_key,
    nan_key_path,
    tree_sizes,
    walk_sizes,
)
from torch_checkpointing.types import CheckpointPath, NestedPath

if TYPE_CHECKING:
    from torch_checkpointing.source_reader import ReadStats, SourceFile

__all__ = [
    "CODECS",
    "RESHARDING_LOAD",
    "SAFETENSORS_DTYPES",
    "TRUST_HINT",
    "Codec",
    "DecodeOptions",
    "SourcePurpose",
    "check_storages_fit",
    "codec_for",
    "dense_tensors",
    "dtype_from_name",
    "file_base_address",
    "load_resharding_source",
    "load_torch",
    "mapped_base",
    "read_safetensors",
    "records_naming",
    "safetensors_dtype",
    "tensor_records",
    "tensor_records_of",
]

logger = logging.getLogger("torch_checkpointing.codecs")

TRUST_HINT = (
    "If you trust this checkpoint, opt in to arbitrary objects with "
    "CheckpointManager.Config(load=CheckpointLoaderConfig(weights_only=False)), or allow the listed classes "
    "with torch.serialization.add_safe_globals([...])."
)


def trust_hint(operation: str) -> str:
    """The fix for a Torch file torch's safe loader refuses, for `operation` (a read context's): a load's option,
    or, to a reader that has none (a CLI command, which said "opt in with CheckpointManager.Config(...)"), that
    it refuses for safety and how to read the file from Python, trusting it."""
    if operation == "load":
        return TRUST_HINT
    return (
        f"This {operation} reads Torch files with torch's safe loader only, for safety: it has no option to trust "
        f"a file. If you trust this checkpoint, load it in Python with "
        f"CheckpointManager.Config(load=CheckpointLoaderConfig(weights_only=False)), or allow the listed classes "
        f"there with torch.serialization.add_safe_globals([...])."
    )


_RESHARD_HINT = "Keep resharded items to tensors, DTensors and plain containers/scalars."


@dataclass(frozen=True)
class SourcePurpose:
    """Who reads an item's files by blocks, as the readers' refusals name it. A resharding load and an export
    share the readers (`Codec.open_source`), and a message written for one named it in the other: an export of a
    crafted file was refused "for a resharding load", with the fix "Keep resharded items to tensors"."""

    source: str  # the file being read: "Refused to load {source} from PATH"
    operation: str  # "File PATH for {operation} cannot be decoded"
    hint: str  # the fix for a Torch file torch's safe loader refuses
    by: str = "load"  # the read context's operation, whose fix a damaged file's refusal names (`on_another`)


RESHARDING_LOAD = SourcePurpose("a resharding source", "a resharding load", _RESHARD_HINT)

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
}
"""safetensors' header dtype names (`"BF16"`) to torch dtypes: the one table for every safetensors reader."""


def safetensors_dtype(name: Any, where: object) -> torch.dtype:
    """The torch dtype of a safetensors header's dtype name; a name not in the table is a newer library's dtype
    (`NewerCheckpointError`: no damage) or a damaged or crafted header, naming the file, not a bare KeyError."""
    dtype = SAFETENSORS_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise unknown_to_this_engine(f"{where}: its safetensors header", "the dtype", name)
    return dtype


def dtype_from_name(name: str) -> torch.dtype | None:
    """The torch dtype `str(dtype)` or its short form names (`"torch.bfloat16"`, `"bfloat16"`), else None."""
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


@dataclass(frozen=True)
class DecodeOptions:
    """How a load reads an item file back: the caller's template (safetensors re-nests against it), where
    tensors go, whether torch files may hold arbitrary objects, whether local files are memory-mapped."""

    template: Any = None
    map_location: Any = None
    weights_only: bool = True
    use_mmap: bool = True
    # Receives where a JSON item and its declared dataclass disagreed without failing (see `RebuildGaps`).
    gaps: RebuildGaps | None = None
    operation: str = "load"  # the read context's operation, whose fix a damaged file's refusal names (`on_another`)


class Codec(ABC):
    """How one serialization format writes, reads, and serves block reads of an item file."""

    @abstractmethod
    def encode(self, fmt: SerializationFormat, key: str, value: Any, stream: IO[bytes]) -> None:
        """Write `value` to `stream`; a value the format cannot hold raises ValueError/TypeError naming `key`."""

    @abstractmethod
    def decode(self, fmt: SerializationFormat, storage: Storage, path: Path, key: str, options: DecodeOptions) -> Any:
        """Read one item file back whole."""

    @abstractmethod
    def open_source(
        self,
        fmt: SerializationFormat,
        storage: Storage,
        path: Path,
        stats: ReadStats,
        *,
        purpose: SourcePurpose = RESHARDING_LOAD,
    ) -> SourceFile:
        """Open one source rank's file for block reads, for `purpose` (which its refusals name); nothing is read
        eagerly beyond headers where the format allows it."""


def load_torch(
    storage: Storage,
    path: Path,
    what: str,
    options: DecodeOptions,
    hint: str | None = None,
    local: str | None = None,
    records: Mapping[int, int] | None = None,
) -> Any:
    """`torch.load` of one file: memory-mapped from `local` when given (a mapping the caller verifies), else
    from the storage's local path (with `options.use_mmap`), else from its bytes. A refusal by torch's safe
    loader is a `RefusedPickleError` naming `what`, the file and `hint` (`trust_hint` of `options.operation` when
    not given); a container torch cannot read, or a
    mapped tensor whose storage runs past its record (`records`: payload offset to size, walked from the
    file when not given), is a `CorruptCheckpointError` naming the file and the fix for `options.operation`."""
    if local is None and options.use_mmap:
        local = storage.local_path(path)
    options = dataclasses.replace(options, map_location=callers_placement(options.map_location, path, what))
    if local is not None and records is None:
        with open(local, "rb") as file:  # before torch reads it: a crafted directory is refused first
            records = records_naming(path, file, options.operation)
    try:
        fix = hint if hint is not None else trust_hint(options.operation)
        value, mapped = _load_refusing_pickles(storage, path, what, options, fix, local)
    except CheckpointError:
        raise
    except OUT_OF_MEMORY:
        raise  # a device with no room for a stored tensor says nothing about the file
    except RuntimeError as exc:
        raise_if_short_of_resources(exc, path, what)
        placed = "" if options.map_location is None else f", or map_location={options.map_location!r} is not here"
        raise CorruptCheckpointError(f"File {path} for {what} is not a readable Torch file{placed}: {exc}") from exc
    except AssertionError as exc:  # torch's unpickler asserts on some records (a persistent id not a tuple)
        raise undecodable(path, what, exc, options.operation) from exc
    _refuse_shared_blowup(path, what, value, options.operation)  # before the first walk of it
    if mapped is not None:
        check_storages_fit(path, value, records, mapped, options.operation)
    return value


OUT_OF_MEMORY: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError)
"""What a device with no room raises (torch's is a RuntimeError): never the file's damage, nor a wrong argument.
Before, a tensor restored onto a full GPU was a `CorruptCheckpointError` ("not a readable Torch file: CUDA out of
memory"), or through a callable map_location a `ConfigError` ("Fix the callable"), and a caller's
`except torch.OutOfMemoryError` (to retry elsewhere) never saw it."""


class EnginePlacement:
    """Base of a `map_location` the engine builds over the caller's argument, which `callers_placement` passes
    on as it is: a `CallersMapLocation`, or the loader's watch for the meta device, whose callable of the caller's
    is a `CallersMapLocation` already and whose dict is torch's own rule (a stored location that rule cannot
    restore here is the file's, as without the watch). Before, the watch over a dict was taken for the caller's
    callable: a file tagged with a location torch cannot restore was a `ConfigError` saying "fix the callable",
    loaded with templates, and a `CorruptCheckpointError` without them."""


def callers_placement(map_location: Any, path: Path, what: str) -> Any:
    """`map_location` as torch.load is given it for `what` in `path`: a callable the caller passed is wrapped in a
    `CallersMapLocation`; anything else (None, a device, a dict, an `EnginePlacement`) as it is."""
    if callable(map_location) and not isinstance(map_location, EnginePlacement):
        return CallersMapLocation(map_location, path, what)
    return map_location


def _as_given(map_location: Any) -> Any:
    """The caller's own `map_location` (not the `CallersMapLocation` wrapping it), for messages that name it."""
    return map_location.call if isinstance(map_location, CallersMapLocation) else map_location


@dataclass(frozen=True)
class CallersMapLocation(EnginePlacement):
    """A callable `map_location` as torch.load calls it, on each storage as the file is read: what it raises, or
    returns that is no storage, is the caller's argument at fault, a `ConfigError` naming it. Before, torch.load
    failing inside it read as the file's damage (`UndecodableFileError`: "the file is damaged or crafted. Load an
    earlier checkpoint"), and a caller that falls back to an earlier checkpoint, or deletes damaged ones, acted on
    an intact checkpoint. None stays torch's "where it was saved"."""

    call: Any
    path: Path
    what: str

    def __repr__(self) -> str:  # torch's own errors name the caller's argument, not this wrapper
        return repr(self.call)

    def __call__(self, storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage | None:
        try:
            placed = self.call(storage, location)
        except OUT_OF_MEMORY:
            raise  # a full device: the callable is right, and the caller's handler for it must see it
        except Exception as exc:
            raise_if_short_of_resources(exc, self.path, self.what)  # the callable's copy found no room: not its bug
            raise self._refusal(location, f"raised {type(exc).__name__}: {exc}") from exc
        if placed is not None and not isinstance(placed, torch.UntypedStorage):
            raise self._refusal(location, f"returned a {type(placed).__name__}, not the storage (or None)")
        return placed

    def _refusal(self, location: str, why: str) -> ConfigError:
        return ConfigError(
            f"load(map_location={self.call!r}) {why}, called on a storage saved on {location!r} while reading "
            f"{self.what} from {self.path}; the checkpoint was not found damaged. Fix the callable: it takes "
            f"(storage, location) and returns the storage moved where it belongs, e.g. storage.cpu(), or None."
        )


MAX_SHARED_PATHS = 1 << 20
"""The most positions a walk of a loaded value may visit beyond the distinct ones, whatever its size: what
containers shared under several paths (a list under two keys, which torch.save keeps shared) add."""

MAX_SHARING = 64
"""Beyond `MAX_SHARED_PATHS`, how many times its distinct entries a walk of a loaded value may visit: a saved
state's list under two keys doubles its entries, whatever their number, so the bound grows with the file. A
pickle's memo lets a few hundred bytes share one list down 60 levels, 2**60 paths, and every walk of the value
(the record check, the merge, a flat view) would never end; with this bound a walk costs at most a fixed
multiple of what the file holds."""


def _refuse_shared_blowup(path: Path, what: str, value: Any, operation: str) -> None:
    blowup = shared_blowup(value)
    if blowup is not None:
        why = ValueError(f"{blowup}; torch.save of a state a save accepts writes no such file")
        raise undecodable(path, what, why, operation)


def shared_blowup(value: Any) -> str | None:
    """Why a walk of `value` visits more positions than a load accepts (`MAX_SHARED_PATHS`, `MAX_SHARING`),
    else None: one rule for the load, which refuses such a file, and the save, which never writes one."""
    return _blowup(*walk_sizes(value))


def _blowup(walked: int, distinct: int) -> str | None:
    most = distinct + max(MAX_SHARED_PATHS, MAX_SHARING * distinct)
    if walked <= most:
        return None
    return (
        f"it holds {distinct} entries, but containers shared under several paths make a walk of it visit "
        f"more than {most}"
    )


def _load_refusing_pickles(
    storage: Storage, path: Path, what: str, options: DecodeOptions, hint: str, local: str | None
) -> tuple[Any, str | None]:
    try:
        try:
            return _torch_load(storage, path, local, options)
        except pickle.UnpicklingError as exc:
            if not options.weights_only or not _needs_dtensor_module(exc):
                raise
            # A file holding pickled DTensors (written by an earlier release of this engine or by the published
            # one): torch's safe loader takes them once their module is loaded, which a plain load skips (~1 s).
            import torch.distributed.tensor  # noqa: F401

            return _torch_load(storage, path, local, options)
    except pickle.UnpicklingError as exc:
        damage = _pickle_damage(storage, path, local)
        if damage is not None:
            raise CorruptCheckpointError(
                f"File {path} for {what} is not a readable Torch file: its pickle stream is damaged ({damage}), so "
                f"no loader, safe or not, reads it. {on_another(options.operation)}"
            ) from exc
        if not options.weights_only:
            raise
        raise RefusedPickleError(
            f"Refused to load {what} from {path} with torch's safe loader (weights_only=True): {exc}\n{hint}"
        ) from exc


def _pickle_damage(storage: Storage, path: Path, local: str | None) -> str | None:
    """Why the file's bytes are no pickle any loader reads, or None where torch's safe loader refused what an
    intact pickle names (a global it does not allow, an opcode of a newer protocol). Decided from the bytes, not
    from the words of torch's error: a regex on them called a `pickle_protocol=4` file, which the unsafe loader
    reads, damage; a file cut inside a global's name ("GLOBAL torch._utils._re was not an allowed global") was a
    refusal whose hint told the user to switch the safety off."""
    if local is not None:
        with open(local, "rb") as file:
            return _stream_damage(file)
    return _stream_damage(io.BytesIO(storage.read(path)))


_LEGACY_PICKLES = 5
"""The pickles a legacy (non-zip) torch.save file opens with: its magic number, protocol version, system info,
the value, and its storages' keys; the storages' raw bytes follow."""


def _stream_damage(file: IO[bytes]) -> str | None:
    """Why `file` holds no Torch file's pickle stream, else None: a zip's data.pkl, or a legacy file's pickles,
    walked opcode by opcode (`pickletools.genops` reads each opcode and its argument, and runs nothing)."""
    file.seek(0)
    if file.read(4) == b"PK\x03\x04":
        try:
            stream = _zip_pickle(file)
        except (CorruptCheckpointError, struct.error, ValueError, OverflowError) as exc:
            return f"its zip directory is damaged: {exc}"
        return "its zip holds no data.pkl" if stream is None else _opcode_damage(io.BytesIO(stream), 1)
    file.seek(0)
    return _opcode_damage(file, _LEGACY_PICKLES)


def _zip_pickle(file: IO[bytes]) -> bytes | None:
    """The bytes of a Torch zip's `<archive>/data.pkl` (stored uncompressed, as torch.save writes it)."""
    walked = _central_directory(file)
    if walked is None:
        return None
    for name, size, header_offset in walked[0]:
        if name.count(b"/") == 1 and name.endswith(b"/data.pkl"):
            file.seek(_payload_offset(file, name, header_offset))
            return file.read(size)
    return None


def _opcode_damage(file: IO[bytes], pickles: int) -> str | None:
    """Why the first `pickles` pickles in `file` do not parse (an unknown opcode, an argument running past the
    end, no STOP), else None."""
    if file.read(1) != pickle.PROTO:  # torch.save writes protocol 2 or later: a pickle opening with its number
        return "it opens with neither a zip header nor a pickle's protocol opcode"
    file.seek(-1, os.SEEK_CUR)
    for _ in range(pickles):
        try:
            for _ in pickletools.genops(file):
                pass
        except ValueError as exc:
            return str(exc)
    return None


def _torch_load(storage: Storage, path: Path, local: str | None, options: DecodeOptions) -> tuple[Any, str | None]:
    """The file's value, and the local path torch memory-mapped it from (None when it read the bytes)."""
    map_location, weights_only = options.map_location, options.weights_only
    if local is not None:
        try:
            return torch.load(local, map_location=map_location, weights_only=weights_only, mmap=True), local
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # only legacy (non-zip) files refuse mmap; re-raise the rest
                raise
    data = io.BytesIO(storage.read(path))
    records_naming(path, data, options.operation)  # refuses a crafted zip directory before torch walks it
    data.seek(0)
    value = torch.load(data, map_location=map_location, weights_only=weights_only)
    return value, None


_TENSOR_RECORD = re.compile(r"(^|/)data/[0-9]+$")
_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


def tensor_records(file: io.RawIOBase | IO[bytes]) -> dict[int, int] | None:
    """Where each tensor record's payload starts in a Torch zip file, and its size; None if not a zip.

    The zip's central directory is walked by hand, without a `ZipInfo` per entry: `zipfile` built one for
    each of a crafted file's 10**6 empty entries (26 s, over 1 GiB, for a 100 MB file). A file holding entries
    torch.save never writes beyond `MAX_OTHER_ENTRIES`, or one name twice, is refused at the first such entry.
    """
    try:
        return _tensor_records(file)
    except (struct.error, ValueError, OverflowError) as exc:  # a field the walk trusted too far
        raise CorruptCheckpointError(f"The zip directory is damaged or crafted ({type(exc).__name__}: {exc}).") from exc


def _tensor_records(file: io.RawIOBase | IO[bytes]) -> dict[int, int] | None:
    walked = _central_directory(file)
    if walked is None:
        return None
    directory, directory_at = walked
    tensors: list[tuple[bytes, int, int]] = []
    starts = [directory_at]  # where each entry's local header begins, and the directory itself
    seen: set[bytes] = set()
    others = 0
    for name, size, header_offset in directory:
        if name in seen:
            raise CorruptCheckpointError(f"Torch zip entry {name!r} appears twice; the file is damaged or crafted.")
        seen.add(name)
        starts.append(header_offset)
        if _TENSOR_RECORD.search(name.decode("utf-8", "replace")) is None:
            others += 1
            if others > MAX_OTHER_ENTRIES:
                raise CorruptCheckpointError(
                    f"Torch zip entry {name!r} is one of more than {MAX_OTHER_ENTRIES} entries that are not "
                    f"tensor records; torch.save writes fewer than 10. The file is damaged or crafted."
                )
            continue
        tensors.append((name, size, header_offset))
    return _placed_records(file, tensors, sorted(starts))


def _placed_records(
    file: io.RawIOBase | IO[bytes], tensors: list[tuple[bytes, int, int]], starts: list[int]
) -> dict[int, int]:
    """Payload offset to size of each tensor record, each ending before the next entry (or the directory)
    begins: a local header whose lengths were changed moves the payload torch reads, and the record would
    come back as other bytes than were saved."""
    records: dict[int, int] = {}
    for name, size, header_offset in tensors:
        payload = _payload_offset(file, name, header_offset)
        following = starts[bisect.bisect_right(starts, header_offset)] if header_offset < starts[-1] else -1
        if payload + size > following:
            raise CorruptCheckpointError(
                f"Tensor record {name.decode('utf-8', 'replace')!r} ({size} bytes at {payload}) runs into the next "
                f"zip entry or the directory (at {following}); the file is damaged or crafted."
            )
        records[payload] = size
    return records


MAX_OTHER_ENTRIES = 64
"""The most entries a Torch zip file may hold besides its tensor records (torch.save writes the pickle,
`version`, `byteorder`, `.format_version`, `.storage_alignment`, `.data/serialization_id`)."""

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # one central directory entry, before its name
_MAX_EOCD_SEARCH = _EOCD.size + 0xFFFF  # the record, then a comment of at most 64 KiB


def _central_directory(file: io.RawIOBase | IO[bytes]) -> tuple[Iterator[tuple[bytes, int, int]], int] | None:
    """(name, stored size, local header offset) of each entry, lazily, and where the directory starts; None
    if the file is not a zip."""
    file.seek(0)
    if file.read(4) != b"PK\x03\x04":  # a zip starts with a local header; legacy torch.save files with a pickle
        return None
    size = file.seek(0, os.SEEK_END)
    tail_at = max(0, size - _MAX_EOCD_SEARCH)
    file.seek(tail_at)
    tail = file.read(size - tail_at) or b""
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _EOCD.size:
        raise CorruptCheckpointError("The zip's end-of-directory record is missing: the file is cut short or damaged.")
    _, _, _, _, count, cd_size, cd_offset, comment_len = _EOCD.unpack_from(tail, at)
    if at + _EOCD.size + comment_len != len(tail):
        # torch.save writes nothing after it; torch reads past such bytes, and the records would go unchecked
        raise CorruptCheckpointError(
            f"{len(tail) - at - _EOCD.size - comment_len} bytes follow the zip's end-of-directory record, which "
            "torch.save never writes: the file is damaged or crafted."
        )
    if 0xFFFF in (count,) or 0xFFFFFFFF in (cd_size, cd_offset):
        count, cd_size, cd_offset = _zip64_directory(file, tail_at + at)
    if cd_offset + cd_size > size:
        raise CorruptCheckpointError(f"The zip directory ({cd_size} bytes at {cd_offset}) runs past the file's end.")
    file.seek(cd_offset)
    directory = file.read(cd_size) or b""
    return _entries(directory, count), cd_offset


def _zip64_directory(file: io.RawIOBase | IO[bytes], eocd_at: int) -> tuple[int, int, int]:
    if eocd_at < _EOCD64_LOCATOR.size:
        raise CorruptCheckpointError("The zip's 64-bit directory locator is missing.")
    file.seek(eocd_at - _EOCD64_LOCATOR.size)
    signature, _, record_at, _ = _EOCD64_LOCATOR.unpack(file.read(_EOCD64_LOCATOR.size))
    file.seek(record_at)
    record = file.read(_EOCD64.size) or b""
    if signature != b"PK\x06\x07" or len(record) < _EOCD64.size or record[:4] != b"PK\x06\x06":
        raise CorruptCheckpointError("The zip's 64-bit directory record is missing or damaged.")
    *_, count, cd_size, cd_offset = _EOCD64.unpack(record)
    return count, cd_size, cd_offset


def _entries(directory: bytes, count: int) -> Iterator[tuple[bytes, int, int]]:
    pos = 0
    for _ in range(count):
        if len(directory) - pos < _CENTRAL.size or directory[pos : pos + 4] != b"PK\x01\x02":
            raise CorruptCheckpointError(f"The zip directory's entry at byte {pos} is damaged.")
        fields = _CENTRAL.unpack_from(directory, pos)
        method, uncompressed, compressed = fields[4], fields[9], fields[8]
        name_len, extra_len, comment_len, header_offset = *fields[10:13], fields[16]
        name = directory[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len]
        extra = directory[pos + _CENTRAL.size + name_len : pos + _CENTRAL.size + name_len + extra_len]
        uncompressed, compressed, header_offset = _zip64_extra(extra, uncompressed, compressed, header_offset)
        _refuse_compressed(name, method, uncompressed, compressed)
        yield name, compressed, header_offset
        pos += _CENTRAL.size + name_len + extra_len + comment_len


def _refuse_compressed(name: bytes, method: int, uncompressed: int, compressed: int) -> None:
    """torch.save stores every entry uncompressed. torch reads a deflated one too, and unchecked: a deflated
    tensor record came back from a mapped load as its compressed bytes (a record a few bytes longer than the
    storage passes the size check), and a 1 MB file inflated a 1 GiB pickle."""
    if method != 0 or uncompressed != compressed:
        raise CorruptCheckpointError(
            f"Torch zip entry {name.decode('utf-8', 'replace')!r} is compressed (method {method}, {compressed} "
            f"bytes holding {uncompressed}); torch.save stores every entry uncompressed. The file is damaged or "
            f"crafted."
        )


def _zip64_extra(extra: bytes, uncompressed: int, compressed: int, header_offset: int) -> tuple[int, int, int]:
    """The 64-bit values a zip64 extra field (id 1) holds for the 32-bit fields set to 0xFFFFFFFF, in order."""
    if 0xFFFFFFFF not in (uncompressed, compressed, header_offset):
        return uncompressed, compressed, header_offset
    at = 0
    while at + 4 <= len(extra):
        kind, length = struct.unpack_from("<HH", extra, at)
        if at + 4 + length > len(extra):
            raise CorruptCheckpointError(
                f"A zip extra field claims {length} bytes where {len(extra) - at - 4} are left: the zip directory "
                f"is damaged or crafted."
            )
        if kind == 1:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            if uncompressed == 0xFFFFFFFF:
                uncompressed = next(values, uncompressed)
            if compressed == 0xFFFFFFFF:
                compressed = next(values, compressed)
            if header_offset == 0xFFFFFFFF:
                header_offset = next(values, header_offset)
            break
        at += 4 + length
    return uncompressed, compressed, header_offset


def _payload_offset(file: io.RawIOBase | IO[bytes], name: bytes, header_offset: int) -> int:
    file.seek(header_offset)
    # One read for the fixed header, the name and torch's alignment padding (under 64 bytes) on a load's hot
    # path; a longer extra field is read on below.
    header = file.read(_LOCAL_HEADER + len(name) + _EXTRA_READ) or b""
    if len(header) < _LOCAL_HEADER:
        raise CorruptCheckpointError(
            f"Tensor record {name.decode('utf-8', 'replace')!r} has its header past the file's end."
        )
    if header[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(
            f"Tensor record {name.decode('utf-8', 'replace')!r}: no zip entry header where the directory puts it."
        )
    method, name_len, extra_len = struct.unpack("<H", header[8:10])[0], *struct.unpack("<HH", header[26:30])
    if method != 0:
        raise CorruptCheckpointError(
            f"Tensor record {name.decode('utf-8', 'replace')!r} is compressed (method {method} in its entry "
            f"header); torch.save stores every entry uncompressed. The file is damaged or crafted."
        )
    local = header[_LOCAL_HEADER : _LOCAL_HEADER + name_len + extra_len]
    if len(local) < name_len + extra_len:
        local += file.read(name_len + extra_len - len(local)) or b""
    if local[:name_len] != name or not _whole_extra_fields(local[name_len:], extra_len):
        raise CorruptCheckpointError(
            f"Tensor record {name.decode('utf-8', 'replace')!r}: its entry header names another file or holds a "
            f"damaged extra field ({name_len} name and {extra_len} extra bytes), so its payload is misplaced. The "
            f"file is damaged or crafted."
        )
    return int(header_offset + _LOCAL_HEADER + name_len + extra_len)


_EXTRA_READ = 128  # bytes of extra field read with a local header in one go


def _whole_extra_fields(extra: bytes, claimed: int) -> bool:
    """Whether `extra` is `claimed` bytes of whole (id, length, data) fields, as zip writers (torch's
    alignment padding among them) write them: a length changed by a few bytes breaks the chain."""
    if len(extra) != claimed:
        return False
    at = 0
    while at + 4 <= claimed:
        at += 4 + struct.unpack_from("<H", extra, at + 2)[0]
    return at == claimed


def records_naming(path: Path, file: io.RawIOBase | IO[bytes], operation: str) -> dict[int, int] | None:
    """`tensor_records`, its refusal naming the file and the fix for `operation`. A refusal of the bytes read
    (a verifying view's checksum, naming the file and its fix) is passed on as it is: it was worded twice."""
    try:
        return tensor_records(file)
    except CorruptCheckpointError as exc:
        if str(path) in str(exc):
            raise
        raise CorruptCheckpointError(f"{path}: {exc} {on_another(operation)}") from None


def tensor_records_of(local: str) -> dict[int, int] | None:
    """`tensor_records` of a local file."""
    with open(local, "rb") as file:
        return tensor_records(file)


def check_storages_fit(path: Path, value: Any, records: Mapping[int, int] | None, mapped: str, operation: str) -> None:
    """Each tensor's storage lies inside its own record of the mapped file. torch's memory-mapped load does
    not compare a record's size with the storage the pickle declares: a shorter record hands back the bytes
    after it (other records, the zip directory) as tensor data."""
    if records is None:
        return  # not a zip (legacy torch.save): torch read it whole, checking each storage's size
    flat = dense_tensors(value)
    st = os.stat(mapped)
    base = mapped_base(flat.values(), mapped, records)
    if base is None:
        logger.debug("No mapping of %s found: its tensor records are not compared with their storages", path)
        return
    for key, tensor in flat.items():
        storage = tensor.untyped_storage()
        if not storage.nbytes() or not base <= storage.data_ptr() < base + st.st_size:
            continue  # empty, or not read from the file (nothing of the file is read past)
        held = records.get(storage.data_ptr() - base)
        if held is None or storage.nbytes() > held:
            raise CorruptCheckpointError(
                f"{path}: tensor {key!r} declares {storage.nbytes()} bytes of storage, but its record in the file "
                f"holds {held if held is not None else 'no'} bytes there; the file is damaged or crafted. "
                f"{on_another(operation)}"
            )


def dense_tensors(value: Any) -> dict[str, torch.Tensor]:
    """Every strided tensor holding data of `value`, under its dotted key (a sparse tensor's parts suffixed)."""
    return {
        f"{key}{part}": dense
        for key, tensor in flatten(value, keep=lambda leaf: isinstance(leaf, torch.Tensor)).items()
        for part, dense in _dense_parts(tensor)
    }


def mapped_base(tensors: Iterable[torch.Tensor], mapped: str, records: Iterable[int] = ()) -> int | None:
    """The address of byte 0 of the file `mapped` where torch mapped it for these tensors (the first one with
    data tells the mapping); None if none has data or no such mapping is found. `records`: the file's tensor
    record offsets, which name the mapping's candidate starts (see `file_base_address`)."""
    pointer = next((t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()), None)
    return None if pointer is None else file_base_address(pointer, os.stat(mapped), records)


def _dense_parts(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The strided tensors whose storages hold `tensor`'s data: itself, or a sparse tensor's index and value
    tensors (a sparse tensor has no storage of its own); none for a nested tensor (no storage to compare)."""
    if tensor.layout == torch.strided:
        return [] if tensor.is_nested else [("", tensor)]
    if tensor.layout == torch.sparse_coo:
        return [(".indices", tensor._indices()), (".values", tensor._values())]
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [
            (".crow_indices", tensor.crow_indices()),
            (".col_indices", tensor.col_indices()),
            (".values", tensor.values()),
        ]
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [
            (".ccol_indices", tensor.ccol_indices()),
            (".row_indices", tensor.row_indices()),
            (".values", tensor.values()),
        ]
    return []


# Candidate starts of a mapping looked up by name before the whole map is read instead.
_NAMED_LOOKUPS = 64


def file_base_address(pointer: int, st: os.stat_result, records: Iterable[int] = ()) -> int | None:
    """The address of byte 0 of the file `st` describes in the mapping holding `pointer` (matched by device and
    inode); None if no such mapping (or no /proc).

    torch maps a whole file from byte 0, so the mapping starts at `pointer` less the offset of the record the
    pointer is in: each page-aligned such start (`records`: the file's record offsets) is looked up by name in
    /proc/self/map_files, a few microseconds each. Reading /proc/self/maps instead costs a line per mapping
    of the process, at every file: a load of 1,000 small files while an earlier load's 1,000 lived spent 2.3 s
    of its 3.4 s there. It remains the way where no start is found by name (an older kernel refuses the names)."""
    page = mmap.PAGESIZE
    length = -(-st.st_size // page) * page
    starts = [pointer - off for off in records if 0 <= off < st.st_size and (pointer - off) % page == 0]
    for start in starts[:_NAMED_LOOKUPS]:
        if _maps_whole_file(start, length, st):
            return start
    return _base_from_process_map(pointer, st)


def _maps_whole_file(start: int, length: int, st: os.stat_result) -> bool:
    """Whether one mapping of this process spans exactly [start, start + length) and maps the file `st`. The
    mapping holding the pointer is then that one (mappings do not overlap), and one of the whole file's length
    is torch's own from byte 0 (a part of it, split off, would be shorter)."""
    try:
        found = os.stat(f"/proc/self/map_files/{start:x}-{start + length:x}")
    except OSError:  # no such mapping, or a kernel that does not name them to this process
        return False
    return found.st_ino == st.st_ino and found.st_dev == st.st_dev


def _base_from_process_map(pointer: int, st: os.stat_result) -> int | None:
    """`file_base_address` from the kernel's map of this process, read line by line."""
    try:
        with open("/proc/self/maps", "rb") as maps:  # bytes: a mapped file's name need not be UTF-8
            for line in maps:
                fields = line.split()
                if len(fields) < 5:
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split(b"-"))
                if lo <= pointer < hi:
                    major, minor = (int(x, 16) for x in fields[3].split(b":"))
                    if int(fields[4]) != st.st_ino or os.makedev(major, minor) != st.st_dev:
                        return None
                    return lo - int(fields[2], 16)
    except OSError as exc:
        logger.debug("Cannot read /proc/self/maps (%s): a mapped file's records are not located", exc)
        return None
    return None


def _needs_dtensor_module(exc: pickle.UnpicklingError) -> bool:
    return "torch.distributed.tensor" in str(exc) and "torch.distributed.tensor" not in sys.modules


def load_resharding_source(
    storage: Storage,
    path: Path,
    local: str | None = None,
    records: Mapping[int, int] | None = None,
    purpose: SourcePurpose = RESHARDING_LOAD,
) -> Any:
    """A Torch file's whole value for block reads (by a resharder, or for `purpose`): on the CPU, torch's safe
    loader, mapped (from `local` when given, its tensor `records` already walked where given) where the storage
    allows."""
    options = DecodeOptions(map_location="cpu", operation=purpose.by)
    return load_torch(storage, path, purpose.source, options, purpose.hint, local, records)


def read_safetensors(storage: Storage, path: Path, key: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file on the CPU under its stored name (mapped where the storage has a
    local path); an unreadable file is a `CorruptCheckpointError` naming `key` and the file."""
    local = storage.local_path(path)
    try:
        if local is not None:
            with open(local, "rb") as file:
                refuse_names_twice(path, file)
            with safe_open(local, framework="pt", device="cpu") as f:
                return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle)
        data = storage.read(path)
        refuse_names_twice(path, io.BytesIO(data))
        return safetensors_load(data)
    except (SafetensorError, ValueError, OverflowError) as exc:
        raise CorruptCheckpointError(f"File {path} for item '{key}' is not a readable safetensors file: {exc}") from exc
    except (OSError, RuntimeError, MemoryError) as exc:  # torch's refused map of it was a bare RuntimeError
        raise_if_short_of_resources(exc, path, f"item '{key}'")
        raise


MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the limit safetensors' own reader applies


def refuse_names_twice(path: Path, file: IO[bytes]) -> None:
    """A header naming one tensor twice: safetensors keeps the last entry silently (another dtype, other bytes),
    where the resharder's header parse refuses it; the direct load refuses it too."""
    head = file.read(8)
    if len(head) < 8:
        return  # too short: safetensors refuses it, naming why
    (length,) = struct.unpack("<Q", head)
    if length <= MAX_SAFETENSORS_HEADER:  # a longer one safetensors refuses before reading it
        parse_safetensors_header(path, file.read(length))


def parse_safetensors_header(path: Path, raw: bytes) -> Any:
    """A safetensors header's JSON, a name given twice or bytes that are not JSON refused naming the file (the
    one parse of the direct load's check and the resharder's ranged reader)."""
    try:
        return json.loads(raw, object_pairs_hook=unique_keys)
    except DuplicateKeyError as exc:
        raise CorruptCheckpointError(f"{path}: its safetensors header is refused: {exc}.") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: its safetensors header is not JSON ({exc}).") from None


class _ZipWriterTarget:
    """What `torch.save` writes to: the item's stream until the save has returned or failed, then nothing.

    torch's zip writer writes the end of its archive from its C++ destructor when the save did not (a Ctrl-C
    that lands in torch.save's `__exit__` before that write), and the destructor runs whenever the writer is
    collected, possibly much later, in another call. Anything raised there, by the stream (closed by then, it
    refuses the write) or by a signal handler (a Ctrl-C landing in a Python `write`), is thrown out of a C++
    destructor, and the process aborts. Released, `write` is the builtin `len`: it takes the bytes, raises
    nothing and runs no Python frame for a signal handler to interrupt.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream: IO[bytes] | None = stream

    def write(self, data: Any) -> int:
        assert self._stream is not None
        return self._stream.write(data)

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.flush()

    def release(self) -> None:
        self.write = len  # type: ignore[method-assign,assignment]
        self._stream = None


_TORCH_SAVE_FAILS: dict[str, Any] = {
    "doing": "saved with TorchSerialization (torch.save pickles the whole value)",
    "op": pickle.dumps,
    "fix": "Make it picklable, or leave it out of the checkpoint.",
}


def _refuse_nan_key(key: str, value: Any) -> None:
    """Refuse a dict key that is or holds NaN before anything is written: unequal to itself, it names no location a
    load can find again (a load into a template with it restored the entry "partially"). Called once the save's
    walk (`tree_sizes`) found one: this pass finds where."""
    path = nan_key_path(value)
    if path is not None:
        raise ConfigError(
            f"Cannot save item '{key}': the dict at {CheckpointPath(key, path[:-1])} has the key {path[-1]!r:.80}, "
            f"which holds NaN; NaN equals nothing, not even itself, so no load could find that entry again. "
            f"Rename the key (e.g. to the str 'nan'). Nothing was saved."
        )


def _refuse_what_no_load_takes(key: str, value: Any) -> None:
    """Refuse, before anything is written and in one pass over the item's containers, a state whose file every
    load would refuse (`shared_blowup`) and a dict key holding NaN (`_refuse_nan_key`)."""
    walked, distinct, nan_key = tree_sizes(value, nan_keys=True)
    blowup = _blowup(walked, distinct)
    if blowup is not None:
        raise ValueError(
            f"TorchSerialization cannot save item '{key}': {blowup}, and a load refuses such a file as crafted. "
            f"Store a container under fewer paths (keep it once and refer to it by name), or store copies."
        )
    if nan_key:
        _refuse_nan_key(key, value)


class TorchCodec(Codec):
    """`torch.save`; read back with torch's safe loader unless the caller trusts the file."""

    def encode(self, fmt: SerializationFormat, key: str, value: Any, stream: IO[bytes]) -> None:
        _refuse_what_no_load_takes(key, value)
        target = _ZipWriterTarget(stream)
        try:
            _refuse_meta_tensors(key, value, "TorchSerialization")
            torch.save(as_written(value), target)  # type: ignore[arg-type]  # it needs only write() and flush()
        except NestingError as exc:
            raise exc.for_item(key) from None
        except RecursionError:
            raise _nested_too_deep("TorchSerialization", key) from None
        except (pickle.PicklingError, TypeError, AttributeError, KeyError, NotImplementedError) as exc:
            raise unpicklable(key, value, exc, **_TORCH_SAVE_FAILS) from exc
        except Exception as exc:  # a value's own __reduce__ may raise anything: named when a leaf raises it
            named = raised_by_a_leaf(key, value, exc, **_TORCH_SAVE_FAILS)
            if named is None:
                raise
            raise named from exc
        finally:
            target.release()

    def decode(self, fmt: SerializationFormat, storage: Storage, path: Path, key: str, options: DecodeOptions) -> Any:
        return load_torch(storage, path, f"item '{key}'", options)

    def open_source(
        self,
        fmt: SerializationFormat,
        storage: Storage,
        path: Path,
        stats: ReadStats,
        *,
        purpose: SourcePurpose = RESHARDING_LOAD,
    ) -> SourceFile:
        from torch_checkpointing.source_reader import open_torch_source

        return open_torch_source(storage, path, stats, purpose)


def _nested_too_deep(fmt_name: str, key: str) -> ValueError:
    return ValueError(
        f"{fmt_name} cannot save item '{key}': it is nested deeper than Python's recursion limit lets the "
        f"encoder walk (a bare RecursionError before). Flatten it, e.g. into a list of its rows."
    )


def _refuse_meta_tensors(key: str, value: Any, fmt_name: str) -> None:
    """A meta tensor restores nothing (and loading it into a real template failed with a bare "Cannot copy out
    of meta tensor"): refused naming the path, like a safetensors file refuses it, with the stager's words."""
    refusal = meta_tensor_refusal(key, value, f"{fmt_name} cannot store")
    if refusal is not None:
        raise refusal


class _TensorlessCodec(Codec):
    """A format that holds no tensors: as a resharding source, every path reads as absent."""

    def open_source(
        self,
        fmt: SerializationFormat,
        storage: Storage,
        path: Path,
        stats: ReadStats,
        *,
        purpose: SourcePurpose = RESHARDING_LOAD,
    ) -> SourceFile:
        from torch_checkpointing.source_reader import _EmptySourceFile

        return _EmptySourceFile()


class JsonCodec(_TensorlessCodec):
    """Pretty-printed JSON with sorted keys; a declared dataclass is rebuilt on read."""

    def encode(self, fmt: SerializationFormat, key: str, value: Any, stream: IO[bytes]) -> None:
        text = _json_text(key, value)
        cls = fmt.cls if isinstance(fmt, JsonSerialization) else None
        _check_loads_back(cls, key, value, json.loads(text))
        stream.write(text.encode("utf-8"))

    def decode(self, fmt: SerializationFormat, storage: Storage, path: Path, key: str, options: DecodeOptions) -> Any:
        data = _json_loads(storage.read(path), path, key)
        cls = fmt.cls if isinstance(fmt, JsonSerialization) else None
        if cls is None:
            return data
        try:
            return from_jsonable(cls, data, f"item '{key}'", options.gaps)
        except (ValueError, TypeError, KeyError) as exc:
            reason = str(exc).rstrip(".")
            raise TemplateMismatchError(
                f"File {path} does not rebuild the {cls.__qualname__} that item '{key}' declares "
                f"(JsonSerialization(cls=...)): {reason}. Declare the class the checkpoint was saved with, or load "
                f"with JsonSerialization() to get the stored JSON as it is."
            ) from exc


class RawCodec(_TensorlessCodec):
    """Bytes written and read as they are."""

    def encode(self, fmt: SerializationFormat, key: str, value: Any, stream: IO[bytes]) -> None:
        if not isinstance(value, bytes):
            raise ValueError(
                f"RawSerialization requires bytes, but key '{key}' has type '{type(value).__name__}'. "
                f"Encode the value to bytes first, or use another serialization format."
            )
        stream.write(value)

    def decode(self, fmt: SerializationFormat, storage: Storage, path: Path, key: str, options: DecodeOptions) -> Any:
        return storage.read(path)


class SafetensorsCodec(Codec):
    """Tensor-only files keyed by dotted keys; re-nested against the caller's template on read."""

    def encode(self, fmt: SerializationFormat, key: str, value: Any, stream: IO[bytes]) -> None:
        metadata = fmt.metadata if isinstance(fmt, SafetensorsSerialization) else None
        try:
            flat = flatten_tensors(value, key)
        except NestingError as exc:
            raise exc.for_item(key) from None
        except RecursionError:
            raise _nested_too_deep("SafetensorsSerialization", key) from None
        stream.write(safetensors_save(flat, metadata=metadata))

    def decode(self, fmt: SerializationFormat, storage: Storage, path: Path, key: str, options: DecodeOptions) -> Any:
        map_location = options.map_location
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            # a ConfigError, so the loader passes it on instead of blaming the (intact) file
            raise ConfigTypeError(
                f"SafetensorsSerialization map_location must be a str or torch.device, got "
                f"{type(_as_given(map_location)).__name__} (item '{key}'). Pass e.g. map_location='cpu'; callables and "
                f"dicts work only for TorchSerialization items."
            )
        device = str(map_location) if map_location is not None else "cpu"
        flat = read_safetensors(storage, path, key)
        if device != "cpu":
            flat = {k: v.to(device) for k, v in flat.items()}
        return flat if options.template is None else unflatten_to_target(flat, options.template)

    def open_source(
        self,
        fmt: SerializationFormat,
        storage: Storage,
        path: Path,
        stats: ReadStats,
        *,
        purpose: SourcePurpose = RESHARDING_LOAD,
    ) -> SourceFile:
        from torch_checkpointing.source_reader import open_safetensors_source

        return open_safetensors_source(storage, path, stats)


CODECS: Mapping[type[SerializationFormat], Codec] = {
    TorchSerialization: TorchCodec(),
    JsonSerialization: JsonCodec(),
    RawSerialization: RawCodec(),
    SafetensorsSerialization: SafetensorsCodec(),
}


def codec_for(fmt: SerializationFormat, key: str | None = None) -> Codec:
    """The codec of `fmt`'s type (or of the nearest registered base class); an unregistered format is a
    ValueError naming its type and, where given, the item key."""
    for cls in type(fmt).__mro__:
        codec = CODECS.get(cls)
        if codec is not None:
            return codec
    where = f" for key '{key}'" if key is not None else ""
    raise ValueError(
        f"Unsupported serialization format{where}: {type(fmt).__name__}. Use one of "
        f"{', '.join(f.__name__ for f in CODECS)}."
    )


def refuse_before_handover(fmt: SerializationFormat, key: str, value: Any) -> None:
    """Raise what encoding `value` as `fmt` would raise, where finding out costs little next to the save: a
    JSON item is encoded (JSON items are small), a safetensors item's names are compared (never its bytes). An
    async save encodes in the writer process; this lets its save() refuse such an item, as a sync save does. A
    torch item's NaN dict keys (`_refuse_what_no_load_takes`) are left to the writer's encode: finding one walks every
    container of the item, and on the caller's thread that cost a no-copy save of an Adam state ~4 ms of blocked
    time for an error seen through the Future just as well."""
    if isinstance(fmt, JsonSerialization):
        codec_for(fmt, key).encode(fmt, key, value, io.BytesIO())
    elif isinstance(fmt, SafetensorsSerialization):
        _check_safetensors_names(key, value)


def _check_safetensors_names(key: str, value: Any) -> None:
    """`flatten_tensors`' name check alone: it also makes every tensor contiguous on the CPU, which copies."""
    try:
        for _ in named_leaves(value, key):
            pass
    except NestingError as exc:
        raise exc.for_item(key) from None
    except RecursionError:
        raise _nested_too_deep("SafetensorsSerialization", key) from None


def _json_text(key: str, value: Any) -> str:
    """The file's text for `value`: pretty-printed, sorted keys; what JSON cannot hold refused naming its path."""
    _check_json_tree(key, value)
    try:
        jsonable = to_jsonable(value)
    except RecursionError:  # the save itself runs deep in the caller's stack
        raise _too_deep(key, "") from None
    try:
        return json.dumps(jsonable, sort_keys=True, indent=4)
    except TypeError as exc:
        raise TypeError(
            f"JsonSerialization cannot encode item '{key}': {exc}. Store JSON-compatible data "
            f"(dict, list, str, int, float, bool, None, dataclasses) or use TorchSerialization."
        ) from exc


def _check_loads_back(cls: type | None, key: str, value: Any, decoded: Any) -> None:
    """Refuse, before anything is written, a value the load would not give back: one `cls` cannot rebuild
    exactly (None in a field annotated `int`, 2.7 in one annotated `int`, a list where a dataclass is declared:
    committed, then every load failed or gave back a different value), and an Enum member that would come back
    as its bare int or str (no annotation rebuilds it there)."""
    loaded = decoded
    if cls is not None:
        try:
            loaded = from_jsonable(cls, decoded, key)
        except (ValueError, TypeError) as exc:
            raise _not_rebuilt(cls, key, str(exc)) from None
        if isinstance(value, cls):  # an instance saves every field: each must come back (a dict may omit some)
            _check_fields_come_back(cls, key, decoded, loaded)
    _check_kinds_come_back(cls, key, value, loaded)


def _not_rebuilt(cls: type, key: str, why: str) -> ValueError:
    return ValueError(
        f"JsonSerialization(cls={cls.__name__}) cannot save item '{key}': the load would not rebuild it as "
        f"saved ({why}). Store values of the annotated types, correct the annotation, or use "
        f"JsonSerialization() (plain JSON) or TorchSerialization for this item."
    )


def _check_fields_come_back(cls: type, key: str, decoded: Any, loaded: Any) -> None:
    """The rebuilt instance writes the same JSON as the saved one: a field the constructor does not take
    (`field(init=False)`, set by `__post_init__`) holding another value than its rebuild gives was lost."""
    try:
        again = json.loads(json.dumps(to_jsonable(loaded)))
    except (TypeError, ValueError) as exc:  # rebuilt as a type JSON does not write (a set from a list)
        raise _not_rebuilt(cls, key, f"it rebuilds as a value JSON cannot hold: {exc}") from None
    where = _first_difference(decoded, again, "")
    if where is not None:
        raise _not_rebuilt(cls, key, f"'{_at(key, where)}' would load back as another value")


def _first_difference(a: Any, b: Any, where: str) -> str | None:
    """The dotted path of the first place two decoded JSON values differ (NaN equal to NaN), else None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            found = _first_difference(a.get(k, _ABSENT), b.get(k, _ABSENT), join_key(where, k))
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        found_any = (_first_difference(x, y, join_key(where, i)) for i, (x, y) in enumerate(zip(a, b, strict=True)))
        return next((f for f in found_any if f is not None), None)
    same = json.dumps(a) == json.dumps(b) if a is not _ABSENT and b is not _ABSENT else a is b
    return None if same else where


_ABSENT = object()


def _check_kinds_come_back(cls: type | None, key: str, value: Any, loaded: Any) -> None:
    """Walk the saved value beside what the load gives back, once: an Enum member must come back as itself,
    and (with `cls`) a dataclass instance or NamedTuple as its own type. JSON writes them as a bare value, an
    object and a list, and only an annotation naming the type rebuilds them; under `Any`, `object`, a union of
    two types or a base class the load would return the bare value, a dict or a list instead."""
    stack: list[tuple[Any, Any, str]] = [(value, loaded, "")]
    while stack:
        saved, back, where = stack.pop()
        if isinstance(saved, enum.Enum):
            if back is not saved:
                raise _enum_lost(key, saved, back, where)
            continue
        if cls is not None and _is_typed_json(saved) and type(back) is not type(saved):
            raise _not_rebuilt(
                cls,
                key,
                f"'{_at(key, where)}' is a {type(saved).__name__}, which the annotation there does not rebuild: "
                f"it would load back as a {type(back).__name__}; annotate that field {type(saved).__name__}",
            )
        for k, v in _json_children(saved) or ():
            child = _child(back, k)
            if child is not _ABSENT:
                stack.append((v, child, join_key(where, k)))


def _is_typed_json(value: Any) -> bool:
    """A value JSON holds only as a plain object or list: a dataclass instance or a NamedTuple."""
    is_instance = dataclasses.is_dataclass(value) and not isinstance(value, type)
    return is_instance or (isinstance(value, tuple) and hasattr(type(value), "_fields"))


def _child(node: Any, k: Any) -> Any:
    """The entry `k` of a loaded container (a field of a rebuilt dataclass); `_ABSENT` where there is none."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return getattr(node, k, _ABSENT)
    if isinstance(node, Mapping):
        return node.get(k, _ABSENT)
    if isinstance(node, list | tuple) and isinstance(k, int) and k < len(node):
        return node[k]
    return _ABSENT


def _enum_lost(key: str, saved: enum.Enum, back: Any, where: str) -> ValueError:
    kind = type(saved).__name__
    return ValueError(
        f"JsonSerialization cannot save item '{key}': the value at '{_at(key, where)}' is {kind}.{saved.name}, "
        f"which JSON holds as {back!r} and the load gives back as that bare {type(back).__name__}. Store "
        f"{saved.value!r} (its .value), declare a dataclass with the field annotated {kind} "
        f"(JsonSerialization(cls=...)), or use TorchSerialization."
    )


def _json_loads(data: bytes, path: Path, key: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=unique_keys)
    except DuplicateKeyError as exc:
        raise CorruptCheckpointError(f"File {path} for item '{key}' is refused: {exc}.") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"File {path} for item '{key}' is not valid JSON ({type(exc).__name__}: {exc})."
        ) from None


JSON_MAX_DEPTH = 256
"""The deepest nesting (containers and dataclasses) a JSON save writes. The conversion to JSON and
`json.loads` recurse per level, from whatever stack depth the save or load runs at: a deeper value failed the
save with a bare RecursionError, or saved and then failed a load called from deeper in a program."""


def _check_json_tree(key: str, value: Any) -> None:
    """Refuse, naming the path, what JSON would not give back as saved: a leaf JSON cannot hold (a set, bytes,
    a tensor), a non-str dict key (an int key loads back as a str and silently misses its template slot), a
    value that contains itself (a `NestingError`, as every other walk refuses a cycle), nesting deeper than
    `JSON_MAX_DEPTH`, and an int too long for Python's int-to-str limit (a bare ValueError from `json.dumps`,
    or a file no load reads). Iterative, so the walk itself never hits the recursion limit."""
    stack: list[tuple[Any, NestedPath, str, int]] = [(value, (), "", 0)]
    on_path: set[int] = set()
    while stack:
        node, path, where, depth = stack.pop()
        if type(node) is _LeftContainer:
            on_path.discard(node.node_id)
            continue
        kids = _json_children(node)
        if kids is None:
            _check_json_leaf(key, node, where)
            continue
        if id(node) in on_path:
            raise NestingError(path, cycle=True).for_item(key)
        if depth >= JSON_MAX_DEPTH:
            raise _too_deep(key, where)
        on_path.add(id(node))
        stack.append((_LeftContainer(node), path, where, depth))
        for k, v in kids:
            if isinstance(node, Mapping):
                _check_json_key(key, k, join_key(where, k))
            stack.append((v, (*path, k), join_key(where, k), depth + 1))


class _LeftContainer:
    """Pushed under a container's children in `_check_json_tree`: popping it means the walk has left that
    container, so meeting it again later is a shared subtree, not a cycle. It holds the container: one a
    Mapping made at the access, dropped while on the path, gave its id to one made below it (a "cycle")."""

    __slots__ = ("node", "node_id")

    def __init__(self, node: Any) -> None:
        self.node, self.node_id = node, id(node)


def _check_json_leaf(key: str, node: Any, where: str) -> None:
    if not isinstance(node, _JSON_LEAVES):
        raise _not_json(key, node, where)
    if type(node) is int and node.bit_length() > _LONG_INT_BITS:
        _check_int_digits(key, node, where)


_JSON_LEAVES = (str, int, float, type(None))
"""The leaf types `json.dumps` writes (bool is an int)."""


def _not_json(key: str, leaf: Any, where: str) -> TypeError:
    """The refusal of a leaf JSON cannot hold, naming its path: `json.dumps` named only its type."""
    return TypeError(
        f"JsonSerialization cannot encode item '{key}': the value at '{_at(key, where)}' is a "
        f"{type(leaf).__module__}.{type(leaf).__qualname__}, which is not JSON serializable. Store JSON-compatible "
        f"data (dict, list, str, int, float, bool, None, dataclasses) or use TorchSerialization."
    )


def _json_children(node: Any) -> Iterable[tuple[Any, Any]] | None:
    """The `(name, child)` pairs `to_jsonable` descends into (a dataclass instance's fields too); None for
    a leaf."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    return children(node) if is_container(node) else None


_LONG_INT_BITS = 14_000  # below Python's default 4300-digit int/str limit: shorter ints need no check


def _check_json_key(key: str, k: Any, where: str) -> None:
    if not isinstance(k, str) or isinstance(k, enum.Enum):  # a str Enum member's key loads back a bare str
        back = k.value if isinstance(k, enum.Enum) else str(k)
        raise TypeError(
            f"JsonSerialization cannot encode item '{key}': dict key {k!r} at '{where}' is a "
            f"{type(k).__name__}, and JSON keys are strings (it would load back as {back!r}). Use str keys, "
            f"or TorchSerialization for dicts with non-str keys."
        )


def _check_int_digits(key: str, value: int, where: str) -> None:
    try:
        str(value)
    except ValueError as exc:
        raise ValueError(
            f"JsonSerialization cannot encode item '{key}': the int at '{_at(key, where)}' has "
            f"{value.bit_length()} bits, over Python's limit on int/str conversion ({exc}), so no loader could "
            f"read it back. Store it as a str, or use TorchSerialization."
        ) from None


def _too_deep(key: str, where: str) -> ValueError:
    return ValueError(
        f"JsonSerialization cannot encode item '{key}': the value at '{_at(key, where)}' is nested more than "
        f"{JSON_MAX_DEPTH} levels deep, deeper than a JSON file is read back. Flatten it, "
        f"or use TorchSerialization."
    )


def _at(key: str, where: str) -> str:
    return f"{key}::{where}" if where else key
