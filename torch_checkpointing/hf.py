"""Hugging Face interop: export an item to HF-layout safetensors shards, and import such a directory.

Export consolidates an item saved on any number of ranks (DTensor shards on any mesh, `_StridedShard`
included) into full tensors, using only the checkpoint's manifest, its `metadata.json` and the public
resharding pieces: every tensor is planned as a load onto a one-rank, fully replicated target
(`compute_load_plans`), and each planned block is read from its source rank's file (`open_source_file`).
It streams: output shards are planned from shapes alone (the shard count is known before any data is
read), and at any time memory holds the tensor being assembled plus the current output shard.

The result is `model-0000k-of-0000n.safetensors` files plus `model.safetensors.index.json`, the layout
`transformers` reads, and loads with `safetensors.torch.load_file`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import re
import shutil
import socket
import stat
import struct
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from torch_checkpointing.codecs import SAFETENSORS_DTYPES, SourcePurpose, refuse_names_twice
from torch_checkpointing.cold_read import private_copy, refuse_beyond_memory
from torch_checkpointing.commit import inside_working_directory
from torch_checkpointing.config import home_expanded, integer_as_int, refuse_unencodable
from torch_checkpointing.discovery import (
    committed_manifest,
    default_storage,
    local_url_refused,
    require_path_type,
    storage_of,
    user_path,
)
from torch_checkpointing.distributed_metadata import (
    METADATA_FILE_NAME,
    DistributedItemMetadata,
    read_distributed_metadata,
    unknown_types_as_stored,
)
from torch_checkpointing.dtensor_metadata import (
    DTensorShardingMetadata,
    ReplicateSpec,
    get_device_mesh_spec,
    refuse_partial_targets,
)
from torch_checkpointing.dtensor_resharder import compute_load_plans, compute_local_runs, compute_local_shard_info
from torch_checkpointing.errors import (
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    CorruptCheckpointError,
    TemplateMismatchError,
    UnsafeCheckpointError,
    on_another,
    raise_if_short_of_resources,
    unreadable_file,
)
from torch_checkpointing.manifest import MANIFEST_FILE_NAME, read_manifest, read_regular_file
from torch_checkpointing.names import fit_name, pid_alive, pid_namespace
from torch_checkpointing.read_context import (
    CheckpointReadContext,
    ReadPolicy,
    checked_relative_path,
    parse_json_bounded,
)
from torch_checkpointing.retention import DEFAULT_UNOWNED_AGE_S
from torch_checkpointing.safetensors_tree import RESERVED_NAME, stores_dtype
from torch_checkpointing.source_reader import (
    FlatTensors,
    ReadStats,
    SourceFile,
    SourceTensor,
    open_source_file,
)
from torch_checkpointing.storage import LOCAL_SCHEMES
from torch_checkpointing.storage.base_storage import Storage, local_store_now
from torch_checkpointing.storage.fsspec_storage import url_scheme
from torch_checkpointing.traversal import dotted_key, is_dtensor, iter_leaves, local_tensor
from torch_checkpointing.types import CheckpointPath, NestedPath
from torch_checkpointing.walk_utils import MISSING, check_shared_targets, check_writable, overlapping_targets

__all__ = ["INDEX_FILE_NAME", "ExportReport", "export_hf", "import_hf", "iter_item_tensors", "parse_size"]

logger = logging.getLogger(__name__)

INDEX_FILE_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3  # transformers' default ("5GB")
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(text: str | int) -> int:
    """`5GB`, `500MB`, `2GiB` or a byte count, the way transformers' `max_shard_size` reads; at least one byte
    (a size of 0 or less would give every tensor a shard of its own without saying so). Digits are ASCII only:
    a regex's `\\d` also reads full-width or Arabic-Indic digits as a size nobody typed, and `True` is an int
    that meant one byte."""
    text = integer_as_int(text)
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ConfigTypeError(
            f"max_shard_size must be a size like '5GB', '500MB', '2GiB' or an int number of bytes, got {text!r} "
            f"({type(text).__name__})"
        )
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text, re.ASCII)
        if not match or match.group(2).upper() not in _UNITS:
            raise ConfigError(
                f"Cannot read size {text!r} (max_shard_size); write e.g. 5GB, 500MB, 2GiB or a number of bytes, "
                f"in the digits 0-9"
            )
        size = _exact_size(match.group(1), _UNITS[match.group(2).upper()], text)
    if size < 1:
        raise ConfigError(f"max_shard_size {text!r} is not a positive size; write e.g. 5GB, 500MB or 2GiB")
    return size


def _exact_size(number: str, unit: int, text: str) -> int:
    """`number` (ASCII digits, perhaps a fraction) times `unit`, in whole bytes, exactly: through a float a count
    past 2**53 bytes came back another count, and one past a float's range raised a bare OverflowError."""
    try:
        return math.floor(Fraction(number) * unit)
    except ValueError:  # more digits than Python turns into an int (sys.get_int_max_str_digits)
        raise ConfigError(
            f"Cannot read size {text[:40]!r}... (max_shard_size, {len(number)} digits); write e.g. 5GB, 500MB, "
            f"2GiB or a number of bytes"
        ) from None


@dataclass(frozen=True)
class _TensorPlan:
    """One tensor to export: its name, global shape/dtype, and how to assemble it."""

    name: str
    path: NestedPath
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool
    stored_key: str  # its key in the saving rank's file: a dotted key does not always split back into its path

    def nbytes(self, dtype: torch.dtype | None) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty((), dtype=_out_dtype(self.dtype, dtype)).element_size()


@dataclass
class ExportReport:
    """What an export wrote: shard file names (then the index), tensor count, bytes of tensor data."""

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "tensors": self.tensors, "total_bytes": self.total_bytes}


def _out_dtype(saved: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    # Like transformers' torch_dtype: only floating-point tensors are cast; integer buffers keep their type.
    return wanted if wanted is not None and saved.is_floating_point else saved


def _checked_rank(rank: Any) -> int | None:
    """None or the plain int of an integer scalar: `False` looked up rank 0's file as a dict key, and a 0-d tensor
    (hashed by identity) matched no rank at all."""
    rank = integer_as_int(rank)
    if rank is not None and type(rank) is not int:
        raise ConfigTypeError(f"rank must be an int (a rank that saved the item) or None, got {rank!r:.80}")
    return rank


@dataclass(frozen=True)
class _Reading:
    """What reads an item through `_ItemSource`, as its refusals name it: an export, or `iter_item_tensors` (what
    `torch-checkpointing diff` compares by), which an export's words ("retry the export", "nothing was exported")
    misled."""

    operation: str  # the read context's operation: "while this {operation} ran ... retry the {operation}"
    nothing: str  # what became of the call when it refused: "Nothing was exported"
    did: str  # "item 'model' for {did}" in the block readers' refusals
    one_rank: str  # how to read one rank's copy of an item saved per rank

    @property
    def undone(self) -> str:
        """What a refusal of a damaged checkpoint adds: what became of the call, and the fix."""
        return f"{self.nothing}. {on_another(self.operation, 'an intact checkpoint')}"

    def purpose(self, key: str) -> SourcePurpose:
        """How the shared block readers name this read in their refusals (not "a resharding load")."""
        return SourcePurpose(
            f"item '{key}' for {self.did}",
            f"{self.did} of item '{key}'",
            f"Torch files are read for {self.did} with torch's safe loader only, so it takes items of tensors and "
            f"plain containers/scalars. {self.undone}",
            self.operation,
        )


_EXPORT = _Reading("export", "Nothing was exported", "the export", "export one rank's copy (rank=R / --rank R)")
_ITER = _Reading("read", "No tensor was read", "iter_item_tensors' read", "read one rank's copy (rank=R)")


class _ItemSource:
    """Reads one item of one checkpoint as full tensors, whichever ranks and layouts wrote it.

    Every byte goes through one verifying `CheckpointReadContext`, as a load's do: paths recorded in the
    checkpoint stay inside it, only regular files listed in the manifest are opened (never a symlink out or a
    FIFO), and what is read is checked against the recorded checksums. Close it (a context manager) when done.
    """

    def __init__(self, storage: Storage, checkpoint: Path, key: str, rank: int | None, reading: _Reading) -> None:
        rank = _checked_rank(rank)
        self._reading = reading
        # the precise reason a directory is not a checkpoint
        committed_manifest(storage, checkpoint, operation=reading.operation)
        policy = ReadPolicy(verify_checksums=True, allow_legacy_checkpoints=False)
        self._ctx = CheckpointReadContext(storage, str(checkpoint), policy, operation=reading.operation).__enter__()
        try:
            self._setup(checkpoint, key, rank)
        except BaseException:
            self._ctx.close()
            raise

    def __enter__(self) -> _ItemSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.close()

    def wait_verified(self) -> None:
        """Raise if any file read whole failed its checksum (ranged reads were checked as they were read)."""
        self._ctx.wait_verified()

    def _setup(self, checkpoint: Path, key: str, rank: int | None) -> None:
        manifest = self._ctx.manifest
        assert manifest is not None  # allow_legacy_checkpoints=False: a directory without one raised
        self.storage, self.checkpoint, self.key = self._ctx.storage_view(f"item '{key}'"), checkpoint, key
        records = sorted((r for r in manifest.files if r.key == key), key=lambda r: r.rank)
        if not records:
            raise KeyError(f"Checkpoint {checkpoint} has no item '{key}'; it holds {sorted(manifest.keys())}.")
        with unknown_types_as_stored():  # a user's resharder's class, which an export never imports
            metadata = read_distributed_metadata(self._ctx, [key])
        self.item_metadata: DistributedItemMetadata | None = metadata.metadata.get(key) if metadata else None
        self._formats = {r.rank: r.serialization_format(checkpoint / MANIFEST_FILE_NAME) for r in records}
        self._paths = {r.rank: r.path for r in records}
        if rank is not None and rank not in self._paths:
            raise ValueError(f"Item '{key}' has no file of rank {rank}; ranks: {sorted(self._paths)}")
        if rank is None and len(records) > 1 and self.item_metadata is None:
            raise ValueError(
                f"Item '{key}' was saved as {len(records)} per-rank files without sharding metadata, so they cannot be "
                f"consolidated; save it with ItemSpec(resharder=DTensorResharder()), or {self._reading.one_rank}."
            )
        self.plain_rank = rank if rank is not None else records[0].rank
        self._ambiguous = rank is None and len(records) > 1
        self._open: dict[int, SourceFile] = {}
        self._stats = ReadStats()
        self._flat: FlatTensors | None = None

    def _source(self, rank: int) -> SourceFile:
        if rank not in self._open:
            fmt = self._formats.get(rank)
            if fmt is None and self.item_metadata is not None:
                fmt = self.item_metadata.get_layout(rank, self.key).serialization_format
            assert fmt is not None
            path = self.checkpoint / self._path(rank)
            self._open[rank] = open_source_file(self.storage, path, fmt, self._stats, self._reading.purpose(self.key))
        return self._open[rank]

    def _path(self, rank: int) -> str:
        """Rank `rank`'s file of the item: the manifest's record, else the one metadata.json names, which must
        be a file the manifest lists for the item (one file shared by every rank); any other was refused by the
        read context as "does not exist", a false reason for a file that is there but is no part of the item."""
        if rank in self._paths:
            return self._paths[rank]
        assert self.item_metadata is not None
        path = self.item_metadata.get_layout(rank, self.key).file_path
        if path not in self._paths.values():
            raise CorruptCheckpointError(
                f"{self.checkpoint / METADATA_FILE_NAME} is damaged or crafted: it names {path} as rank {rank}'s "
                f"file of item '{self.key}', but {self.checkpoint / MANIFEST_FILE_NAME} lists no such file of that "
                f"item (its files: {sorted(set(self._paths.values()))}). {self._reading.undone}"
            )
        return path

    def plans(self) -> list[_TensorPlan]:
        """Every tensor of the item, in the saving rank's order, planned from metadata and headers only."""
        out: list[_TensorPlan] = []
        sharded: set[NestedPath] = set()
        if self.item_metadata is not None:
            for path, groups in self.item_metadata.nested_path_to_metadata.items():
                md = groups[0].sharding_metadata
                if isinstance(md, DTensorShardingMetadata):
                    name = dotted_key(path)
                    out.append(_TensorPlan(name, tuple(path), tuple(md.global_shape), md.torch_dtype, True, name))
                    sharded.add(tuple(path))
        flat = self._plain()
        names = {p.name for p in out}
        for name in flat:
            if name not in names:
                if self._ambiguous:
                    raise ValueError(
                        f"Tensor {name!r} of item '{self.key}' has no DTensor sharding metadata but the item was saved "
                        f"as {len(self._paths)} per-rank files: which rank's copy to {self._reading.operation} is "
                        f"ambiguous; {self._reading.one_rank}."
                    )
                shape, dtype = flat.describe(name)  # from the header (or a mapping): no tensor bytes read
                path = tuple(name.split(".")) if name else ()
                out.append(_TensorPlan(name, path, shape, dtype, False, name))
        # A bare-tensor item has the empty name; HF needs one: the item key.
        named = [p if p.name else dataclasses.replace(p, name=self.key) for p in out]
        _check_unique_names(named, f"{self.checkpoint}::{self.key}", self._reading)
        return named

    def _plain(self) -> FlatTensors:
        """Every tensor of the plain rank's file, lazily (mmap for torch files, header-only for safetensors).

        A Torch file holds a nested value, which the flat view names by dotted keys: two tensors whose paths
        give one name (`{"a.b": t, "a": {"b": u}}`) would reach it as one, and the export would hold only one
        of them; they are refused here, naming both paths."""
        if self._flat is None:
            source = self._source(self.plain_rank)  # one open of the file, shared with the block reads
            _check_tensor_names(source.entry(()), f"{self.checkpoint}::{self.key}", self._reading)
            _refuse_sparse(source.entry(()), f"{self.checkpoint}::{self.key}", self._reading)
            _refuse_expanded(source.entry(()), self.checkpoint / self._path(self.plain_rank), self.key, self._reading)
            self._flat = FlatTensors(source)
        return self._flat

    def read(self, plan: _TensorPlan) -> torch.Tensor:
        """The full tensor of `plan` (a fresh, contiguous CPU tensor)."""
        if not plan.sharded:
            return self._plain()[plan.stored_key].detach().to("cpu").contiguous().clone()
        assert self.item_metadata is not None
        groups = self.item_metadata.nested_path_to_metadata[plan.path]
        source_md = groups[0].sharding_metadata
        assert isinstance(source_md, DTensorShardingMetadata)
        whole = DTensorShardingMetadata(
            tuple(source_md.global_shape),
            source_md.dtype,
            _contiguous_stride(source_md.global_shape),
            get_device_mesh_spec("cpu", (1,), (0,), None),
            (ReplicateSpec(),),
        )
        load_plans = compute_load_plans(plan.path, whole, groups, 0)
        if load_plans is None:
            raise self._corrupt(plan, "the saved shards it describes do not cover the whole tensor")
        sources = self._checked_sources(plan, groups, {lp.src_rank for lp in load_plans})
        out = torch.empty(plan.shape, dtype=plan.dtype)  # only now: every shard it names is as large as it says
        for lp in load_plans:
            block = sources[lp.src_rank].read_block(lp.src_offsets, lp.src_sizes, self._stats)
            out[tuple(slice(o, o + s) for o, s in zip(lp.offsets, lp.sizes, strict=True))] = block
        return out

    def _checked_sources(self, plan: _TensorPlan, groups: list[Any], ranks: set[int]) -> dict[int, SourceTensor]:
        """Each source rank's saved shard of `plan`, refused unless it has the shape and dtype the metadata's
        global shape and placements give that rank.

        Checked before the full tensor is allocated: a crafted `global_shape` would otherwise make the export
        allocate terabytes (or, smaller than saved, export a silently truncated tensor).
        """
        sources: dict[int, SourceTensor] = {}
        for rank in sorted(ranks):
            src = self._source(rank).tensor(plan.path)
            if src is None:
                raise self._corrupt(plan, f"rank {rank}'s file {self._path(rank)} holds no such tensor")
            md = next(g.sharding_metadata for g in groups if rank in g.ranks)
            expected, _ = compute_local_shard_info(md, rank)
            wrong = [
                name
                for name, differs in (
                    ("global_shape", tuple(src.shape) != tuple(expected)),
                    ("dtype", src.dtype != plan.dtype),
                )
                if differs
            ]
            if wrong:
                raise self._corrupt(
                    plan,
                    f"it gives rank {rank} a {tuple(expected)} {plan.dtype} shard, but its file "
                    f"{self._path(rank)} holds {tuple(src.shape)} {src.dtype}",
                    " and ".join(wrong),
                )
            sources[rank] = src
        return sources

    def _corrupt(self, plan: _TensorPlan, why: str, fields: str = "global_shape") -> CorruptCheckpointError:
        """`fields`: the metadata fields that disagree with the shards, named as the file spells them (a dtype
        that disagreed was blamed on the global_shape; then the global_shape went unnamed where it was wrong)."""
        return CorruptCheckpointError(
            f"{self.checkpoint / METADATA_FILE_NAME} is damaged or crafted: the {fields} it records for "
            f"{self.key}::{plan.name} (a {plan.shape} {plan.dtype} tensor) does not fit the saved shards ({why}). "
            f"{self._reading.undone}"
        )


def _check_tensor_names(value: Any, what: str, reading: _Reading) -> None:
    """Refuse two tensor leaves of a saved value that one name (a safetensors name in an export) would hold, and
    log the non-tensor leaves `reading` leaves out. `value` is `MISSING` for formats that hold flat tensors only."""
    seen: dict[str, NestedPath] = {}
    skipped: list[str] = []
    for path, leaf in iter_leaves(value) if value is not MISSING else ():
        name = dotted_key(path)
        if not isinstance(leaf, torch.Tensor):
            skipped.append(name)
        elif name in seen:
            raise _merged_names_error(what, name, seen[name], path, reading)
        else:
            seen[name] = path
    if skipped:
        listed = ", ".join(repr(n) for n in skipped[:10])
        more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
        logger.info(
            "%s: %d non-tensor leaves are not among the tensors %s takes (it takes tensors only): %s%s",
            what,
            len(skipped),
            reading.did,
            listed,
            more,
        )


def _refuse_sparse(value: Any, what: str, reading: _Reading) -> None:
    """A sparse (or other non-strided) tensor, refused before a shard is written and naming it: safetensors
    holds dense tensors only (torch's error from inside the writer named neither the tensor nor the fix)."""
    for path, leaf in iter_leaves(value) if value is not MISSING else ():
        if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
            raise ValueError(
                f"Cannot {reading.operation} {what}: the tensor at path {path!r} is {leaf.layout}, and {reading.did} "
                f"takes dense tensors only. Save it dense (tensor.to_dense()), or leave it out of the item. "
                f"{reading.nothing}."
            )


def _refuse_expanded(value: Any, file: Path, key: str, reading: _Reading) -> None:
    """A tensor with more elements than its storage holds (a stride-0 `expand`), refused as crafted: no save of
    ours writes one (they are written dense), and an export writes it dense, so a file of a few bytes became a
    shard of any size (and the memory to assemble it): a crafted 1.5 KB checkpoint exported 512 MiB."""
    for path, leaf in iter_leaves(value) if value is not MISSING else ():
        if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
            continue
        needed = leaf.numel() * leaf.element_size()
        if needed > leaf.untyped_storage().nbytes():
            raise CorruptCheckpointError(
                f"{file} is damaged or crafted: the tensor at path {path!r} of item '{key}' has {tuple(leaf.shape)} "
                f"elements ({needed} bytes) over a storage of {leaf.untyped_storage().nbytes()} bytes (a stride-0 "
                f"view), which no save writes. {reading.undone}"
            )


def _check_unique_names(plans: list[_TensorPlan], what: str, reading: _Reading) -> None:
    """Refuse two planned tensors of one name (sharded paths from metadata.json included): a shard file and the
    index hold one tensor per name."""
    seen: dict[str, NestedPath] = {}
    for plan in plans:
        if plan.name in seen:
            raise _merged_names_error(what, plan.name, seen[plan.name], plan.path, reading)
        seen[plan.name] = plan.path


def _merged_names_error(what: str, name: str, first: NestedPath, second: NestedPath, reading: _Reading) -> ValueError:
    return ValueError(
        f"Cannot {reading.operation} {what}: the tensors at paths {first!r} and {second!r} both take the name "
        f"{name!r} (a dict key holding a '.', an int key beside an equal str key, or an empty key, which takes the "
        f"item key), and {reading.did} holds one tensor per name. Rename those keys in the model's state before "
        f"saving. {reading.nothing}."
    )


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def iter_item_tensors(
    checkpoint: str | os.PathLike[str], key: str, *, rank: int | None = None, storage: Storage | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (dotted name, full tensor) for every tensor of item `key`, one at a time (consolidated across ranks)."""
    source_storage = storage_of(checkpoint, storage, "checkpoint")
    checkpoint = user_path(checkpoint, source_storage)
    with _ItemSource(source_storage, Path(checkpoint), key, rank, _ITER) as source:
        for plan in source.plans():
            yield plan.name, source.read(plan)
        source.wait_verified()


def _assign_shards(plans: list[_TensorPlan], max_shard_size: int, dtype: torch.dtype | None) -> list[list[_TensorPlan]]:
    """The split huggingface_hub's `split_torch_state_dict_into_shards` makes (transformers' save_pretrained):
    in order, a shard is closed when the next tensor would take it past the limit; a tensor larger than the
    limit gets a shard of its own and the open shard stays open (closing it made one more file than HF's)."""
    shards: list[list[_TensorPlan]] = []
    current: list[_TensorPlan] = []
    size = 0
    for plan in plans:
        n = plan.nbytes(dtype)
        if n > max_shard_size:
            shards.append([plan])
            continue
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(plan)
        size += n
    return [*shards, current] if current else shards


def export_hf(
    checkpoint: str | os.PathLike[str],
    key: str,
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    rank: int | None = None,
    storage: Storage | None = None,
    overwrite: bool = False,
) -> ExportReport:
    """Write item `key` of `checkpoint` as HF-layout safetensors shards plus the index into `out_dir`.

    `dtype` casts floating-point tensors (e.g. torch.bfloat16); `rank` exports one rank's own copy of an item
    saved per rank without sharding metadata. Non-tensor leaves (safetensors holds tensors only) are skipped.

    All or nothing: the shards and index are written into a hidden sibling of `out_dir` (a hidden folder inside
    it when it is on another file system than its parent: `_staging_parent`) and moved in only once
    every tensor was read and verified, the index last, so a failed or killed export never leaves a directory
    that looks like a complete export; the hidden sibling of a SIGKILLed export is removed by the next export
    beside it, once its process is gone. `out_dir` may exist and hold other files (a `config.json`); one that
    already holds an export is refused unless `overwrite`, which replaces only the export's own files.
    """
    _check_local_out_dir(out_dir)
    out = _output_path(out_dir)
    shard_size = parse_size(max_shard_size)
    _check_cast(dtype)
    source_storage = storage_of(checkpoint, storage, "checkpoint")
    checkpoint = user_path(checkpoint, source_storage)
    with _ItemSource(source_storage, Path(checkpoint), key, rank, _EXPORT) as source:
        _check_out_dir(out, Path(checkpoint), overwrite)
        plans = source.plans()
        if not plans:
            raise ValueError(f"Item '{key}' of {checkpoint} holds no tensors to export")
        _refuse_unexportable(plans, dtype, f"{checkpoint}::{key}")
        shards = _assign_shards(plans, shard_size, dtype)
        staging = _make_staging(out)
        try:
            report = _write_export(source, shards, staging, dtype, f"{checkpoint}::{key} to {out}")
            source.wait_verified()
            with _publishing_beside(out):
                try:
                    _publish(staging, out, report, overwrite, Path(checkpoint))
                except OSError as exc:
                    raise OSError(
                        f"Could not move the finished export of {checkpoint}::{key} into {out} ({exc}): {out} does "
                        f"not hold it. Check that {out.parent} lets you rename and remove entries (permissions, an "
                        f"append-only or read-only file system) and export again."
                    ) from exc
        finally:
            _remove_staging(staging)
    return report


def _check_cast(dtype: torch.dtype | None) -> None:
    """`dtype` must be a floating-point dtype: it casts floating-point tensors only (as transformers'
    `torch_dtype` does), and a cast of weights to an integer or complex type would silently change them."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ConfigError(
            f"dtype={dtype!r} (--dtype) is not a floating-point torch dtype; it casts the floating-point tensors "
            f"of the export, so give e.g. torch.bfloat16, torch.float16 or torch.float32, or none to keep the "
            f"saved dtypes"
        )


def _make_staging(out: Path) -> Path:
    """Create `out`'s parent (if needed) and the hidden staging folder that the export is written into (beside
    `out`, or inside it: `_staging_parent`), naming `out` and the fix when that fails (a bare error naming the
    hidden folder before)."""
    where = out.parent
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        where = _staging_parent(out)
        for parent in {out.parent, where}:
            _remove_dead_stagings(parent)
        staging = where / _staging_name(out.name, os.getpid(), uuid.uuid4().hex[:8])
        staging.mkdir()
    except OSError as exc:
        raise type(exc)(
            exc.errno,
            f"Could not create the export's hidden staging folder beside {out} ({exc.strerror}: {exc.filename}); "
            f"nothing was exported. An export is written beside its output folder and moved in whole, so "
            f"{where} must be a directory you can write to: choose another output folder or fix its "
            f"permissions",
        ) from exc
    return staging


def _staging_parent(out: Path) -> Path:
    """Where the export is staged: beside `out`, on the file system its files move to. An existing `out` on
    another file system than its parent (a mount point such as a container's volume, or a symbolic link to a
    folder on another disk) is staged inside itself: a rename cannot cross file systems, and moving the shards
    in failed with EXDEV, an overwrite's after it had removed the earlier export's index."""
    if out.is_dir() and os.stat(out).st_dev != os.stat(out.parent).st_dev:
        return out
    return out.parent


def _remove_staging(staging: Path) -> None:
    """Remove an export's staging directory (gone already once it was published); one that stays is named."""
    try:
        shutil.rmtree(staging)
    except FileNotFoundError:
        return
    except OSError as exc:
        logger.warning(
            "Could not remove the export's staging directory %s (%s); it holds no export. Delete it by hand (an "
            "export into the same folder removes it too, once this process has ended).",
            staging,
            exc,
        )


def _refuse_unexportable(plans: list[_TensorPlan], dtype: torch.dtype | None, what: str) -> None:
    """Refuse, before a shard is written, a tensor whose dtype safetensors cannot hold (a bare KeyError from
    inside the library before, after the shards before it were written), or one named as the header's
    metadata entry (written, then every load of that shard failed on a duplicate `__metadata__` field)."""
    reserved = [p.path for p in plans if p.name == RESERVED_NAME]
    if reserved:
        raise ValueError(
            f"Cannot export {what}: the tensor at path {reserved[0]!r} takes the name {RESERVED_NAME!r}, which "
            f"safetensors reserves for a file's metadata (the shard would not load). Rename that key before "
            f"saving; nothing was exported."
        )
    for plan in plans:
        try:
            plan.name.encode("utf-8")  # a shard's header is UTF-8: safetensors failed with a bare UnicodeEncodeError
        except UnicodeEncodeError as exc:
            raise ConfigError(
                f"Cannot export {what}: the tensor at path {plan.path!r} is named {plan.name!r}, which holds "
                f"{plan.name[exc.start]!r}, a lone surrogate that a safetensors header (UTF-8) cannot hold. Rename "
                f"that key before saving; nothing was exported."
            ) from None
    written = [(p.name, _out_dtype(p.dtype, dtype)) for p in plans]
    bad = [(name, kind) for name, kind in written if not stores_dtype(kind)]
    if bad:
        listed = ", ".join(f"{name} ({kind})" for name, kind in bad[:10])
        raise ValueError(
            f"Cannot export {what}: safetensors has no dtype for {len(bad)} tensor(s): {listed}. An HF export holds "
            f"safetensors only; convert those tensors before saving (e.g. complex128 to complex64)."
        )


_SINGLE_FILE = "model.safetensors"  # an unsharded HF export's one file
_EXPORT_FILE_RE = re.compile(r"^model(-[0-9]{5,}-of-[0-9]{5,})?\.safetensors$")  # 5 digits, more past 99999 shards
# safetensors' `save_file` writes each shard to a temporary of its own beside it (Rust's tempfile: `.tmp` and 6
# letters or digits) and renames it: an export killed while it wrote a shard, most of its time, left one.
_SHARD_TEMPORARY_RE = re.compile(r"^\.tmp[0-9A-Za-z]{6}$")
# `{pid}-{where}{nonce}`: `where` (8 hex digits) names the host and pid namespace the pid belongs to; names
# written before it was recorded have the 8-digit nonce alone.
_STAGING_RE = re.compile(r"^\..+\.export-tmp-(?P<pid>[0-9]+)-(?P<mark>[0-9a-f]+)$")
# A staging of another host or pid namespace (whose pid cannot be checked here) is removed once this old.
_FOREIGN_STAGING_AGE_S = DEFAULT_UNOWNED_AGE_S


def _staging_name(name: str, pid: int, nonce: str) -> str:
    """The hidden sibling an export of `name` is written into (cut to fit NAME_MAX, as the engine's own are)."""
    return fit_name(".", name, f".export-tmp-{pid}-{_where()}{nonce}")


def _where() -> str:
    """This host and pid namespace, as 8 hex digits: a pid is only meaningful there. Two containers that
    share a volume (or two hosts sharing a file system) each see the other's exporting pid as gone."""
    return f"{zlib.crc32(f'{socket.gethostname()}:{pid_namespace()}'.encode()):08x}"


def _staging_dead(path: Path, match: re.Match[str]) -> bool:
    """Whether the export writing `path` has certainly ended: its pid is gone and was one of this host and pid
    namespace; a staging of another (or of an older version, which did not say) only once it is a day old, by
    the clock that stamped it (the file server's: `local_store_now`; by this host's, one more than a day ahead
    of its server removed another host's live export)."""
    where = match["mark"][:8] if len(match["mark"]) == 16 else None
    if where == _where():
        return not pid_alive(int(match["pid"]))
    if where is None and not pid_alive(int(match["pid"])):
        return True  # an older version's name: judged as before, by the pid alone
    try:
        written = path.stat().st_mtime  # first: nothing there, no probe made beside it
    except FileNotFoundError:
        return False  # removed meanwhile
    return local_store_now(path.parent) - written > _FOREIGN_STAGING_AGE_S


def _remove_dead_stagings(parent: Path) -> None:
    """Remove what SIGKILLed exports left beside their outputs: hidden `.export-tmp-` folders whose process is
    gone and that hold nothing but export files. Anything else under such a name is left, with a WARNING."""
    for name in sorted(os.listdir(parent)):
        match = _STAGING_RE.match(name)
        path = parent / name
        if match is None or path.is_symlink() or not path.is_dir() or not _staging_dead(path, match):
            continue
        foreign = [n for n in os.listdir(path) if not _written_by_an_export(n)]
        if foreign:
            logger.warning(
                "Left %s alone: named like an unfinished export, but it holds %s, which an export never writes",
                path,
                ", ".join(sorted(foreign)[:5]),
            )
            continue
        shutil.rmtree(path)
        logger.warning("Removed %s: the unfinished output of an export whose process (pid %s) died", path, match["pid"])


def _written_by_an_export(name: str) -> bool:
    """Whether an export's staging folder may hold `name`: its shards, its index, a shard's temporary."""
    return name == INDEX_FILE_NAME or bool(_EXPORT_FILE_RE.match(name) or _SHARD_TEMPORARY_RE.match(name))


def _export_files(out: Path) -> list[str]:
    """The files of an earlier export in `out` (the shards and index this function writes)."""
    return sorted(n for n in os.listdir(out) if n == INDEX_FILE_NAME or _EXPORT_FILE_RE.match(n))


def _enclosing_checkpoint(target: Path) -> Path | None:
    """The committed checkpoint directory that `target` is or lies in, if any: one whose manifest.json reads
    as a checkpoint's (another tool's manifest.json, a web app's, does not count)."""
    for folder in (target, *target.parents):
        if os.path.isfile(folder / MANIFEST_FILE_NAME):
            try:
                if read_manifest(default_storage(), folder) is not None:
                    return folder
            except (CheckpointError, ValueError, OSError):
                continue
    return None


def _check_local_out_dir(out_dir: str | os.PathLike[str]) -> None:
    """An export is written to a local directory: a URL there made a local folder named `s3:`. A path of no path
    type (bytes, None) is refused naming it, as the readers refuse a root: it failed in a regex, naming nothing."""
    scheme = url_scheme(require_path_type(out_dir, "export's output"))
    if scheme is not None:
        raise ConfigError(
            f"The export's output {os.fspath(out_dir)!r} is a {scheme}:// URL, but an export is written to "
            f"a local directory (and fsynced there). Export to a local path, then upload that folder "
            f"(`huggingface-cli upload`, `aws s3 sync`)."
        )


def _check_local_directory(directory: str | os.PathLike[str]) -> None:
    """An import reads a local directory: a URL went through `Path`, which folded `file:///abs/hf` into the
    relative `file:/abs/hf`, and the import said that path had no index, of an export that is complete."""
    scheme = url_scheme(require_path_type(directory, "import_hf's directory"))
    if scheme is None:
        return
    url = os.fspath(directory)
    if scheme in LOCAL_SCHEMES:
        raise local_url_refused(url, scheme, "import_hf reads a local directory; ")
    raise ConfigError(
        f"import_hf reads a local directory; {url!r} is a {scheme}:// URL. Download the folder first "
        f"(`huggingface-cli download`, `aws s3 sync`) and import that local directory."
    )


def _output_path(out_dir: str | os.PathLike[str]) -> Path:
    """`out_dir` made absolute ("." and "a/.." have no name to put a hidden sibling beside), refused when it is
    the file system's root, which has neither a name nor a parent to stage the export in. A leading `~` is
    expanded, as the checkpoint's path is: `~/hf` was written as a folder named '~' in the working directory."""
    refuse_unencodable("Export output", out_dir)
    out = Path(os.path.abspath(home_expanded(out_dir)))
    if not out.name:
        raise ConfigError(
            f"Export output {os.fspath(out_dir)!r} is the file system's root: an export is staged beside its "
            f"output folder and moved in whole, so export to a folder of its own (e.g. /hf_model)"
        )
    return out


def _resolved_output(out: Path) -> Path:
    """`out` with its links resolved; one that is or lies under a loop of symbolic links is named with the fix
    (pathlib's bare `RuntimeError: Symlink loop from ...` before; Python 3.13 raises an OSError instead)."""
    try:
        return out.resolve()
    except (RuntimeError, OSError) as exc:
        raise OSError(
            errno.ELOOP,
            f"Export output {out} goes through a loop of symbolic links ({exc}); nothing was exported: choose "
            f"another output folder or fix the link",
        ) from None


def _check_out_dir(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """Refuse an output that is inside the checkpoint (or any other, or a working directory of the engine), is
    not a directory, or holds an export (unless `overwrite`): nothing is written before these are known."""
    target, source = _resolved_output(out), checkpoint.resolve()
    if target == source or source in target.parents:
        raise ConfigError(f"Export output {out} lies inside the checkpoint {checkpoint}; choose a directory outside it")
    if (why := inside_working_directory(target)) is not None:
        raise ConfigError(f"Export output {out}: {why}; choose a directory outside it")
    other = _enclosing_checkpoint(target)
    if other is not None:
        raise ConfigError(
            f"Export output {out} lies inside the checkpoint {other}: the export's files would become part of "
            f"that directory, so retention could never delete it; choose a directory outside every checkpoint"
        )
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise FileExistsError(f"Export output {out} exists and is not a directory; choose a new directory")
    existing = _export_files(out)
    if existing and not overwrite:
        raise FileExistsError(
            f"Export output {out} already holds an export ({', '.join(existing[:3])}"
            f"{', ...' if len(existing) > 3 else ''}); pass overwrite=True (--overwrite) to replace those files, "
            f"or export to a new directory"
        )


def _write_export(
    source: _ItemSource, shards: list[list[_TensorPlan]], staging: Path, dtype: torch.dtype | None, what: str
) -> ExportReport:
    """Every shard, then the index, into `staging`."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    report = ExportReport()
    weight_map: dict[str, str] = {}
    # safetensors creates its files mode 0600 whatever the umask: a shard then read as the index does, by the
    # umask, which the staging folder's own mode holds (mkdir applied it), less the execute bits.
    file_mode = stat.S_IMODE(os.stat(staging).st_mode) & 0o666
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {p.name: source.read(p).to(_out_dtype(p.dtype, dtype)) for p in shard}
        try:
            save_file(tensors, str(staging / name), metadata={"format": "pt"})
            os.chmod(staging / name, file_mode)
            _fsync(staging / name)
        except SafetensorError as exc:  # a disk full or a file-size limit arrives as this, not as an OSError
            raise _write_failed(f"export shard {name}", what, _os_errno(str(exc)), str(exc)) from exc
        report.total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        weight_map.update({p.name: name for p in shard})
        report.files.append(name)
        logger.info("Exported %s (%d tensors) of %s", name, len(shard), what)
    report.tensors = len(weight_map)
    index = {"metadata": {"total_size": report.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    try:
        (staging / INDEX_FILE_NAME).write_text(json.dumps(index, indent=2, sort_keys=True, allow_nan=False) + "\n")
        _fsync(staging / INDEX_FILE_NAME)
        _fsync(staging)
    except OSError as exc:  # a disk full or a file-size limit: bare "[Errno 27] File too large" before
        raise _write_failed(f"the export's {INDEX_FILE_NAME}", what, exc.errno, exc.strerror) from exc
    report.files.append(INDEX_FILE_NAME)
    return report


def _os_errno(text: str) -> int | None:
    """The errno in safetensors' error text ("I/O error: File too large (os error 27)"), which keeps it nowhere
    else."""
    found = re.search(r"\(os error ([0-9]+)\)", text)
    return int(found.group(1)) if found else None


def _write_failed(file: str, what: str, code: int | None, reason: str | None) -> OSError:
    """An export file that could not be written: the OS error's errno (so callers can tell a full disk), what
    was not written, and the fix."""
    return OSError(
        code,
        f"Could not write {file} of {what} ({reason}); nothing was exported: free space (or raise the file-size "
        f"limit) and export again",
    )


@contextlib.contextmanager
def _publishing_beside(out: Path) -> Iterator[None]:
    """Hold an exclusive flock on the parent directory of the folder `out` resolves to while an export moves
    in: two exports into one folder at once (both with --overwrite) would otherwise interleave their file moves
    and leave one's index over a mix of both one's shards, which looks complete. Resolved, because the folder
    reached through a link (`/a/hf -> /real/hf`) and by its real path had two parents, so two locks, and the
    exports did not take turns. Nothing is written for the lock; on a file system without flock on directories
    the publish goes ahead unlocked, with a DEBUG line."""
    try:
        fd = os.open(Path(os.path.realpath(out)).parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        logger.debug("Publishing %s without a lock (%s)", out, exc)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            logger.debug("Publishing %s without a lock (%s)", out, exc)
        yield
    finally:
        os.close(fd)  # drops the lock


def _publish(staging: Path, out: Path, report: ExportReport, overwrite: bool, checkpoint: Path) -> None:
    """Move a finished export into `out`: one rename when `out` is new; else the new shards, then the new index
    over the old in one rename, then the stale files of an earlier export. A kill at any point leaves one whole
    export in `out`, the earlier or the new, unless a new shard takes an old one's name (the same shard count):
    then the old index goes first, so that the folder stops looking complete rather than pair it with new bytes."""
    _check_out_dir(out, checkpoint, overwrite)  # again: another process may have written there meanwhile
    if not os.path.lexists(out):
        os.rename(staging, out)
        _fsync(out.parent)
        return
    shards, with_index = report.files[:-1], out / INDEX_FILE_NAME
    stale = set(_export_files(out)) - set(report.files)
    if any(os.path.lexists(out / name) for name in shards):
        _unlink_if_there(with_index)
    for name in shards:
        os.replace(staging / name, out / name)
    if _SINGLE_FILE in stale:  # transformers reads it before an index: it must not outlive the old export
        os.unlink(out / _SINGLE_FILE)
    os.replace(staging / INDEX_FILE_NAME, with_index)
    for name in sorted(stale - {INDEX_FILE_NAME, _SINGLE_FILE}):
        os.unlink(out / name)  # named by no index now: harmless until removed, and an overwrite removes them
    _fsync(out)


def _unlink_if_there(path: Path) -> None:
    if os.path.lexists(path):
        os.unlink(path)


def _fsync(path: Path) -> None:
    """Flush a written file (or a directory's entries) to disk: without it a power cut after the export
    returned could leave an index naming shards whose bytes never reached the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------ import


_MAX_INDEX_BYTES = 64 * 1024 * 1024


def _hf_files(directory: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index, or from the single `model.safetensors`.

    A downloaded directory is untrusted input: the index is read bounded, and every shard it names must be a
    plain file name in `directory` (no path out of it) naming a regular file (a FIFO would hang the read).
    Symbolic links to regular files are followed: a Hugging Face cache snapshot is made of them.
    """
    _require_folder(directory)
    index = directory / INDEX_FILE_NAME
    if _lexists(index):
        _refuse_single_file_beside(index)
        doc = parse_json_bounded(_regular_bytes(index, _MAX_INDEX_BYTES), str(index))
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise CorruptCheckpointError(f"{index}: field 'weight_map' must be an object of tensor name -> file name")
        files = {str(k): _shard_name(v, index) for k, v in weight_map.items()}
        if not files:
            raise CorruptCheckpointError(
                f"{index} names no tensor (its 'weight_map' is empty); the download is damaged or incomplete. "
                f"Download it again."
            )
        _refuse_incomplete_series(set(files.values()), index)
        for name in sorted(set(files.values())):
            _regular(directory / name)
        return files
    _listable(directory)
    found = sorted(directory.glob("*.safetensors"))
    for shard in found:  # a shard of a series without its index: a download not finished, whatever else is there
        _refuse_lone_shard_of_series(shard, index)
    _refuse_no_single_model(directory, found)
    _regular(found[0])
    with _open_shard(found[0], private=False) as f:  # its names only: the header
        return dict.fromkeys(f.keys(), found[0].name)


_SERIES_RE = re.compile(r"^(?P<stem>.+)-(?P<k>[0-9]{5,})-of-(?P<n>[0-9]{5,})\.safetensors$")  # `model-00002-of-00003`


def _refuse_incomplete_series(shards: set[str], index: Path) -> None:
    """Every `k-of-N` series the index's shard names announce must be named whole: each HF shard holds at least
    one tensor, so an index leaving a shard of its series out lost that shard's entries, and its tensors went
    missing from the import without a word."""
    series: dict[tuple[str, int], set[int]] = {}
    for shard in shards:
        match = _SERIES_RE.match(shard)
        if match:
            series.setdefault((match["stem"], int(match["n"])), set()).add(int(match["k"]))
    for (stem, n), numbers in sorted(series.items()):
        absent = [k for k in range(1, min(n, len(numbers) + 10) + 1) if k not in numbers][:10]
        if absent or len(numbers) != n:
            named = ", ".join(f"{stem}-{k:05d}-of-{n:05d}.safetensors" for k in absent) or "numbers past the series"
            raise CorruptCheckpointError(
                f"{index} names {len(numbers)} of the {n} shards of {stem}-*-of-{n:05d} and leaves out {named}: its "
                f"'weight_map' lost those shards' tensors (the download is damaged or incomplete, or the index was "
                f"edited). Download the index again."
            )


def _refuse_single_file_beside(index: Path) -> None:
    """`model.safetensors` beside an index: transformers reads the single file first and never the index, so
    importing the index returned other weights than transformers loads from the same folder. Which one is the
    model is unknown (a folder two tools wrote into, an overwrite by hand), so neither is imported."""
    single = index.parent / _SINGLE_FILE
    if _lexists(single):
        raise CorruptCheckpointError(
            f"{index.parent} holds both {_SINGLE_FILE} and {INDEX_FILE_NAME}: transformers loads {single} and "
            f"ignores the index, so which is the model is unknown. Remove the one that is not (or the stale "
            f"shards with the index), then import again."
        )


# What `import_hf` takes, in its refusals of a path that is not such a folder.
_HF_FOLDER = (
    f"the folder an HF download or export_hf wrote (it holds {_SINGLE_FILE}, or {INDEX_FILE_NAME} and the shards "
    f"it lists)"
)


def _require_folder(directory: Path) -> None:
    """The path the caller named must be a folder: a missing one or a file is the caller's error (no damage),
    named with what to pass. Before, a missing folder read "has no index and not exactly one *.safetensors
    file", and a file raised the OS's NotADirectoryError naming the index inside it."""
    try:
        mode = os.stat(directory).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"import_hf: {directory}: no such directory; pass {_HF_FOLDER}") from None
    except NotADirectoryError:  # a path under a file
        raise NotADirectoryError(
            f"import_hf: {directory} is not a folder (a part of it is a file); pass {_HF_FOLDER}"
        ) from None
    except PermissionError as exc:  # a folder on the way this user may not search
        raise unreadable_file(directory, _HF_DIRECTORY, exc) from exc
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise OSError(
            errno.ELOOP,
            f"import_hf: {directory} goes through a loop of symbolic links ({exc.strerror}); fix the link, or "
            f"pass {_HF_FOLDER}",
        ) from None
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(f"import_hf: {directory} is a file, not a folder; pass {_HF_FOLDER}")


def _refuse_no_single_model(directory: Path, found: list[Path]) -> None:
    """Without an index, the folder must hold exactly one `*.safetensors` file. None: the caller named another
    folder (or a download not begun), a `FileNotFoundError` naming it. Several: which one is the model is unknown
    (an adapter beside it, two tools' outputs), so none is imported: a `ConfigError` naming them and the fix. Both
    were one bare `FileNotFoundError` that named neither the files nor the fix."""
    if not found:
        raise FileNotFoundError(
            f"import_hf: {directory} holds neither {INDEX_FILE_NAME} nor a *.safetensors file; pass {_HF_FOLDER}"
        )
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:10]) + (f" (of {len(found)})" if len(found) > 10 else "")
        raise ConfigError(
            f"import_hf: {directory} holds several *.safetensors files ({names}) and no {INDEX_FILE_NAME}, so which "
            f"one is the model is unknown and none is imported. Move the files that are not the model out of the "
            f"folder (or import from a folder holding the model alone), or add the index that lists its shards."
        )


def _refuse_lone_shard_of_series(shard: Path, index: Path) -> None:
    """Without an index, one shard named `k-of-N` with N > 1 is a download that has not finished (the index and
    the other shards still to come), not the whole model."""
    match = _SERIES_RE.match(shard.name)
    if match and int(match["n"]) > 1:
        raise CorruptCheckpointError(
            f"{shard} is shard {int(match['k'])} of {int(match['n'])} and {index} is missing: the download is "
            f"incomplete. Download the index and the other shards, then import again."
        )


@contextlib.contextmanager
def _reading_shard(path: Path) -> Iterator[None]:
    """What safetensors raises on a shard that is not what its header says (truncated, damaged, crafted): a
    `CorruptCheckpointError` naming the shard, not a bare `SafetensorError` naming nothing. A process short of
    memory or descriptors is told as that, naming the shard (`errors.raise_if_short_of_resources`): torch's
    refused map of a shard larger than the memory there is came out as a bare `RuntimeError`."""
    from safetensors import SafetensorError

    try:
        yield
    except (RuntimeError, OSError, MemoryError) as exc:
        raise_if_short_of_resources(exc, path, "the import")
        raise
    except (SafetensorError, ValueError, OverflowError, EOFError, struct.error) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise_if_short_of_resources(exc, path, "the import")
        raise CorruptCheckpointError(
            f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc}); the download is damaged or "
            f"incomplete. Download it again."
        ) from exc


@contextlib.contextmanager
def _open_shard(path: Path, private: bool = True) -> Iterator[Any]:
    """A shard opened with safetensors, its header checked as a checkpoint's is (a tensor named twice, which
    safetensors resolves silently to the last entry, is refused).

    Opened once, without blocking, its type checked on the descriptor and read through it only: opened by name
    after `_regular` had checked it, a shard swapped for a FIFO meanwhile blocked the import forever, and
    safetensors' own open by name could read another file than the header check did. `private`: read from a
    copy in memory (`_in_memory`), for tensors returned as they are read; else the shard itself is mapped, for
    a look at its header or a copy into templates (`_MappedShard`)."""
    with _opened_shard(path, private) as (handle, _, _):
        yield handle


@dataclass
class _MappedShard:
    """A shard an import into templates copies out of its mapping (no copy of it in memory: every shard is open
    at once there, which held the model's size again in RAM, on every rank of a DTensor template that reads only
    its own part). `refuse_if_shrunk` is asked before the first fill: a shard truncated after it was opened
    is refused with nothing copied, where its mapping killed the process with SIGBUS. (One truncated during the
    fills themselves still does: the limit of loads into templates, docs/durability.md.)"""

    handle: Any
    refuse_if_shrunk: Callable[[], None]


@contextlib.contextmanager
def _open_mapped_shard(path: Path) -> Iterator[_MappedShard]:
    with _opened_shard(path, private=False) as (handle, fd, size):

        def refuse_if_shrunk() -> None:
            now = os.fstat(fd).st_size
            if now < size:
                raise CorruptCheckpointError(
                    f"{path} has {now} bytes, but had {size} when this import opened it: another process truncated "
                    f"it. Nothing was copied. Download it again, or retry once the other process is done."
                )

        yield _MappedShard(handle, refuse_if_shrunk)


@contextlib.contextmanager
def _opened_shard(path: Path, private: bool) -> Iterator[tuple[Any, int, int]]:
    """(safetensors' handle, the descriptor it reads, the shard's size when it was opened)."""
    from safetensors import safe_open

    fd = _open_named(path)
    try:
        st = os.fstat(fd)
        _refuse_irregular(st.st_mode, path)
        copy = _in_memory(fd, path) if private else None
        if copy is not None:
            os.close(fd)
            fd = copy
        with _reading_shard(path):
            with os.fdopen(os.dup(fd), "rb") as file:
                refuse_names_twice(path, file)
            opened = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
            with safe_open(opened, framework="pt", device="cpu") as f:
                yield f, fd, st.st_size
    finally:
        os.close(fd)


def _in_memory(fd: int, path: Path) -> int | None:
    """The shard's bytes copied into memory (`cold_read.private_copy`), its own descriptor closed: safetensors
    maps what it opens, and a shard truncated after it was opened (a download rewritten meanwhile) killed the
    process with SIGBUS at the first touch of a page past its new end; one written into changed the tensors a
    flat import had returned. The header check and every read then see the same bytes. The copy costs the
    shard's size in memory while it is open; a flat import opens one shard at a time. None where the system has
    no memfd: the shard is read itself, as before. A shard larger than the memory there is is refused first, as
    a load refuses such a file (`cold_read.refuse_beyond_memory`): its copy filled the machine's memory."""
    size = os.fstat(fd).st_size
    refuse_beyond_memory(size, str(path), "the import")
    short = lambda at: CorruptCheckpointError(  # noqa: E731
        f"{path} ended at byte {at} while it was read, but had {size} bytes: another process truncated it. "
        f"Download it again, or retry once the other process is done."
    )
    try:
        return private_copy(fd, size, short)
    except OSError as exc:  # the memfd's own descriptor, or its memory: a bare "[Errno 24]" before
        raise_if_short_of_resources(exc, path, "the import")
        raise


def _shard_name(value: Any, index: Path) -> str:
    name = checked_relative_path(value, f"{index}: field 'weight_map'")
    if "/" in name:
        raise UnsafeCheckpointError(
            f"{index}: field 'weight_map' names {value!r}; shard files must be plain file names beside the index."
        )
    return name


def _regular(path: Path) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _gone(path) from None
    except PermissionError as exc:  # a directory on the way this user may not search
        raise unreadable_file(path, _HF_FILE, exc) from exc
    _refuse_irregular(st.st_mode, path)


# What an HF directory's files are, in the refusal of one this user may not read.
_HF_FILE = "a file of an HF safetensors directory"
_HF_DIRECTORY = "an HF safetensors directory"


def _lexists(path: Path) -> bool:
    """`os.path.lexists`, except that a folder this user may not search is said so: it answered "no", and a
    complete download in a folder closed to this user was refused as having "no model.safetensors.index.json".
    A path that is no folder (a file passed for the folder holding it) is a `FileNotFoundError` saying so, not
    the OS's "Not a directory" naming the index under it."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except PermissionError as exc:
        raise unreadable_file(path.parent, _HF_DIRECTORY, exc) from exc
    except NotADirectoryError:  # `model.safetensors` itself passed for its folder, or a path under a file
        raise FileNotFoundError(
            f"{path.parent} is not a directory: import_hf reads the folder that holds {_SINGLE_FILE}, or "
            f"{INDEX_FILE_NAME} and its shards; pass that folder."
        ) from None
    return True


def _listable(directory: Path) -> None:
    """A folder this user may search but not list is said so (`glob` finds nothing in it, silently)."""
    try:
        os.listdir(directory)
    except PermissionError as exc:
        raise unreadable_file(directory, _HF_DIRECTORY, exc) from exc
    except FileNotFoundError:
        return  # named by the caller's own error


def _open_named(path: Path) -> int:
    """A file of the directory opened for reading without blocking (a FIFO swapped in is refused after, by type).
    One this user may not read is a `PermissionError` naming it and the fix, as a checkpoint's file is: before,
    the OS's bare "[Errno 13] Permission denied", which said neither. No descriptor left says so too (a bare
    "[Errno 24]" before)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _gone(path) from None
    except PermissionError as exc:
        raise unreadable_file(path, _HF_FILE, exc) from exc
    except OSError as exc:
        raise_if_short_of_resources(exc, path, "the import")
        raise


def _gone(path: Path) -> CorruptCheckpointError:
    """A file the directory names (by its index, or by a link of a hub cache) that is not there: a download that
    did not finish or lost a file, or a deletion meanwhile. Before, a bare `FileNotFoundError`, which a caller
    catching `CheckpointError` for a damaged download never saw (and a dangling link was worded as an export's)."""
    return CorruptCheckpointError(
        f"{path} is named by the directory (its index, or a link in a hub cache) but does not exist: the download "
        f"is incomplete, or the file was deleted. Download it again; nothing was imported."
    )


def _refuse_irregular(mode: int, path: Path) -> None:
    if not stat.S_ISREG(mode):
        raise UnsafeCheckpointError(
            f"{path} is not a regular file (mode {stat.filemode(mode)}); an HF export holds regular files only."
        )


def _regular_bytes(path: Path, limit: int) -> bytes:
    """An index's bytes, read as an engine file is (`read_regular_file`): what it holds, not `limit` bytes
    reserved up front (64 MiB per import, before), and never blocking on a FIFO swapped in after the type
    check. Links are followed: the HF hub's cache links every file of a snapshot into its blobs."""
    _regular(path)
    fd = _open_named(path)
    try:
        return read_regular_file(fd, path, "an index", limit)
    finally:
        os.close(fd)


def _leaves(template: Any) -> list[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor leaf of a template, named as a checkpoint's safetensors file
    would name it."""
    return [(dotted_key(path), leaf) for path, leaf in iter_leaves(template) if isinstance(leaf, torch.Tensor)]


def import_hf(directory: str | os.PathLike[str], into: Any = None) -> Any:
    """Load an HF safetensors directory: a flat `name -> tensor` dict, or filled into `into`'s tensors in place.

    Plain template tensors are filled whole; DTensor templates get only their local shard (read with
    `get_slice`, so a rank reads its part only). A template tensor the directory lacks, or one whose shape or
    dtype differs, raises `TemplateMismatchError` before anything is copied.
    """
    _check_local_directory(directory)
    base = Path(home_expanded(directory))  # `~/hf`, as export_hf writes it
    files = _hf_files(base)
    if into is None:
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(files.values())):
            with _open_shard(base / shard) as f, _reading_shard(base / shard):
                names = list(f.keys())
                _refuse_disagreeing(base, shard, names, files)
                for name in names:
                    out[name] = f.get_tensor(name)
        absent = sorted(name for name in files if name not in out)
        if absent:
            raise CorruptCheckpointError(
                f"{base / INDEX_FILE_NAME} lists tensor(s) {absent[:10]} (of {len(absent)}) that the shards it names "
                f"do not hold; the download is damaged or incomplete. Download it again."
            )
        return out
    leaves = _tied_to_a_received(_leaves(into), files)
    missing = sorted(name for name, _ in leaves if name not in files)
    if "" in missing:
        raise _unnamed_template_tensor(directory, files)
    if missing:
        raise TemplateMismatchError(f"{directory} has no tensor(s) {missing[:10]} (of {len(missing)} missing)")
    _warn_not_received(base, files, leaves)
    with contextlib.ExitStack() as handles:
        opened: dict[str, _MappedShard] = {}
        held: dict[str, set[str]] = {}  # each opened shard's tensor names
        checks: list[tuple[str, Path, Any, torch.Tensor]] = []
        for name, leaf in leaves:
            shard = files[name]
            if shard not in opened:
                opened[shard] = handles.enter_context(_open_mapped_shard(base / shard))
                held[shard] = set(opened[shard].handle.keys())
                _refuse_disagreeing(base, shard, held[shard], files)
            with _reading_shard(base / shard):
                if name not in held[shard]:
                    raise CorruptCheckpointError(
                        f"{base / INDEX_FILE_NAME} names {shard!r} for tensor {name!r}, which that shard does not "
                        f"hold; the download is damaged or incomplete."
                    )
                checks.append((name, base / shard, opened[shard].handle.get_slice(name), leaf))
        refuse_partial_targets("", into)  # worded for this load, before anything is copied
        for name, _, sl, leaf in checks:  # every tensor checked (its local runs planned) before any is copied
            _check_fits(name, tuple(sl.get_shape()), sl.get_dtype(), leaf)
            check_writable(f"HF tensor {name!r}", local_tensor(leaf))
        fills: list[_Fill] = [(name, file, sl, leaf, _local_runs(leaf)) for name, file, sl, leaf in checks]
        _refuse_tied_differing(fills)
        for mapped in opened.values():
            mapped.refuse_if_shrunk()
        for _, file, sl, leaf, runs in fills:
            with _reading_shard(file):
                _fill(sl, leaf, runs)
    return into


def _unnamed_template_tensor(directory: str | os.PathLike[str], files: dict[str, str]) -> TemplateMismatchError:
    """A template tensor of the empty name (a bare tensor, or the key `""`), which the directory lacks: an HF
    tensor needs a name, and `export_hf` gives that one its item's key, which the import cannot know. Before,
    "has no tensor(s) ['']", which said neither why nor how to import what `export_hf` had written."""
    names = sorted(files)
    return TemplateMismatchError(
        f"{directory} has no tensor of the empty name that the template holds (a bare tensor, or the key ''): "
        f"export_hf names that tensor by its item's key, as HF tensors need a name. Import into a template that "
        f"holds it under that key ({{'<item key>': tensor, ...}}); the directory holds {names[:10]} "
        f"(of {len(names)}). Nothing was copied."
    )


def _tied_to_a_received(
    leaves: list[tuple[str, torch.Tensor]], files: dict[str, str]
) -> list[tuple[str, torch.Tensor]]:
    """`leaves` without those the directory lacks that are exactly another received entry's tensor (the same
    memory, read the same way): transformers' `save_pretrained` stores a tied weight once (no `lm_head.weight`
    beside `embed_tokens.weight`), and filling the one fills the other. The import refused the model's own
    state dict as a template, naming the tied entry as missing."""
    received = [leaf for name, leaf in leaves if name in files]
    return [(name, leaf) for name, leaf in leaves if name in files or not any(_same_view(leaf, r) for r in received)]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    if is_dtensor(a) or is_dtensor(b) or a.device != b.device or a.dtype != b.dtype or a.numel() == 0:
        return False  # empty tensors of their own may share the null address: no tie
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _warn_not_received(base: Path, files: dict[str, str], leaves: list[tuple[str, torch.Tensor]]) -> None:
    """Name (WARNING) the directory's tensors no template entry receives, as a non-strict load names the entries
    it did not restore: they were left out silently (a template missing `lm_head.weight` imported without it)."""
    received = {name for name, _ in leaves}
    left = sorted(name for name in files if name not in received)
    if left:
        logger.warning(
            "import_hf of %s restored the template partially: %d tensor(s) of the directory are not in the template "
            "and were not imported: %s%s. Add them to the template, or import without one to get every tensor.",
            base,
            len(left),
            left[:10],
            " ..." if len(left) > 10 else "",
        )


def _refuse_disagreeing(base: Path, shard: str, names: Iterable[str], files: dict[str, str]) -> None:
    """Every tensor an opened shard holds must be one the index places in it, whether the import is flat or
    fills a template: a templated import read the index's copy and never looked at the rest, so a download the
    flat import refused was imported silently with a template."""
    for name in sorted(names):
        if files.get(name) != shard:  # the index places it in another shard, or nowhere
            raise _index_disagrees(base, name, files.get(name), shard)


def _index_disagrees(base: Path, name: str, indexed: str | None, shard: str) -> CorruptCheckpointError:
    """A shard holding a tensor the index places elsewhere: which copy is the model's is unknown (a flat import
    returned whichever shard came last in name order)."""
    said = f"places it in {indexed!r}" if indexed is not None else "does not list it"
    return CorruptCheckpointError(
        f"{base / shard} holds tensor {name!r}, but {base / INDEX_FILE_NAME} {said}; the index and its shards "
        f"disagree, so the download is damaged or mixes two exports. Download it again."
    )


_Fill = tuple[str, Path, Any, torch.Tensor, "tuple[list[Any], ...] | None"]


def _refuse_tied_differing(fills: list[_Fill]) -> None:
    """Template tensors sharing memory (tied weights, overlapping views) that the directory fills with different
    values are refused before the first copy, as a load refuses them (`walk_utils.check_shared_targets`): the
    later copy won silently. Only entries whose memory overlaps another's are read here."""
    targets = [(CheckpointPath(name, ()), leaf) for name, _, _, leaf, _ in fills]
    tied = {str(where) for pair in overlapping_targets(targets) for where in pair}
    if not tied:
        return
    copies = []
    for name, shard, sl, leaf, runs in fills:
        if str(CheckpointPath(name, ())) in tied:
            scratch = torch.empty_like(local_tensor(leaf))
            with _reading_shard(shard):
                _fill(sl, scratch, runs, local=True)
            copies.append((CheckpointPath(name, ()), scratch, leaf))
    check_shared_targets(copies)


def _check_fits(name: str, shape: tuple[int, ...], st_dtype: str, leaf: torch.Tensor) -> None:
    if tuple(leaf.shape) != shape or SAFETENSORS_DTYPES.get(st_dtype) != leaf.dtype:
        raise TemplateMismatchError(
            f"HF tensor {name!r} is {shape} {st_dtype} but the template holds {tuple(leaf.shape)} {leaf.dtype}"
        )


def _local_runs(leaf: torch.Tensor) -> tuple[list[Any], ...] | None:
    """The global slices a DTensor template's local shard receives (None for a plain tensor, filled whole)."""
    if not is_dtensor(leaf):
        return None
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    return compute_local_runs(DTensorShardingMetadata.from_dtensor(leaf), rank)


def _fill(sl: Any, leaf: torch.Tensor, runs: tuple[list[Any], ...] | None, local: bool = False) -> None:
    """Copy the slice into the template `leaf` (into `leaf` itself, taken as the local shard, when `local`)."""
    with torch.no_grad():
        if runs is None:
            leaf.copy_(sl[tuple(slice(0, n) for n in leaf.shape)] if leaf.dim() else sl[...])
        else:
            _copy_runs(sl, runs, leaf if local else local_tensor(leaf))


def _copy_runs(sl: Any, runs: tuple[list[Any], ...], local: torch.Tensor) -> None:
    """Copy each block of global runs into its local position (several runs per dim under _StridedShard)."""
    import itertools

    for combo in itertools.product(*runs):
        g = tuple(slice(r.global_start, r.global_start + r.length) for r in combo)
        loc = tuple(slice(r.local_start, r.local_start + r.length) for r in combo)
        local[loc] = sl[g]
