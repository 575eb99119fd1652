"""Writing one rank's share of a checkpoint, and the atomic commit of the whole.

Every rank writes its item files into a temporary directory beside the target and fsyncs them. Rank 0 then
collects every rank's file records (through a TCPStore when there are several ranks), writes the sharding
metadata and the manifest, fsyncs, and renames the directory into place; the other ranks wait for rank 0's
verdict, so every rank's save ends only after the commit. The same function runs inline for sync saves and
in the background writer process for async ones.
"""

from __future__ import annotations

import json
import pickle
import time
import posixpath
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import IO, Any

from torch_checkpointing.barriers import BarrierConfig
from torch_checkpointing.checkpoint_layout import SerializationFormat
from torch_checkpointing.distributed_metadata import METADATA_FILE_NAME as METADATA_JSON
from torch_checkpointing.encoding import encode
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME, FileRecord, Manifest
from torch_checkpointing.storage.base_storage import Storage, StorageConfig
from torch_checkpointing.store_channel import StoreAddress, StoreChannel
from torch_checkpointing.types import RankInfo
from torch_checkpointing.version import __version__

__all__ = [
    "CheckpointWriter",
    "CheckpointWriterArgs",
    "CheckpointWriterConfig",
    "WriteEntry",
    "WriteRequest",
    "write_checkpoint",
    "METADATA_JSON",
]

# Non-zero ranks wait this much longer than rank 0 so that rank 0's verdict (naming the late rank) arrives first.
_VERDICT_GRACE_S = 2.0



@dataclass
class CheckpointWriterConfig:
    """The writer: barrier timeout and barrier between ranks, and how many threads write files."""

    checkpoint_write_barrier_timeout_sec: int = 600
    barrier_config: BarrierConfig | None = None
    file_write_max_threads: int = 1

    def __post_init__(self) -> None:
        if self.file_write_max_threads < 1:
            raise ValueError("file_write_max_threads must be positive")


@dataclass
class WriteEntry:
    key: str
    file_path: str  # relative to the checkpoint directory, {rank} already filled in
    fmt: SerializationFormat
    value: Any
    pickled: bool = False  # `value` holds pickle bytes (a requires_copy=False value on its way to the writer)


@dataclass
class WriteRequest:
    checkpoint_dir: str
    tmp_dir: str
    rank: int
    world_size: int
    entries: list[WriteEntry]
    metadata_json: str | None = None  # rank 0 only
    store: StoreAddress | None = None  # None: single rank, no coordination
    timeout_s: float = 600.0
    file_write_max_threads: int = 1
    # Called as f(final_path, event_logger) before the commit and after it; must pickle for async saves.
    pre_finalize_callback: Callable[[str, Any], None] | None = None
    finalize_callback: Callable[[str, Any], None] | None = None
    step: int | None = None
    metrics: dict[str, float] | None = None


class _ChecksumStream:
    """Forwards writes to `inner`, counting bytes and a running CRC32."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.size = 0
        self.crc32 = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += len(view)
        self.inner.write(view)
        return len(view)

    def flush(self) -> None:
        self.inner.flush()


def _write_entry(storage: Storage, root: Path, rank: int, entry: WriteEntry) -> FileRecord:
    value = pickle.loads(entry.value) if entry.pickled else entry.value
    target = root / entry.file_path
    with storage.stream_write(target) as raw:
        # Streams that checksum what they write (the local filesystem's, off the encoding thread) are used as
        # they are; any other backend's stream is wrapped.
        stream: Any = raw if hasattr(raw, "crc32") and hasattr(raw, "size") else _ChecksumStream(raw)
        encode(entry.fmt, entry.key, value, stream)
    return FileRecord(entry.key, rank, entry.file_path, stream.size, stream.crc32, entry.fmt.to_dict())


def _write_local_files(storage: Storage, request: WriteRequest) -> list[FileRecord]:
    root = Path(request.tmp_dir)
    storage.mkdir(root)
    storage.write(root / INCOMPLETE_MARKER, b"")
    directories = {root}
    for entry in request.entries:
        parent = root / posixpath.dirname(entry.file_path)
        if parent not in directories:
            storage.mkdir(parent)
            directories.add(parent)
    if request.file_write_max_threads > 1 and len(request.entries) > 1:
        with ThreadPoolExecutor(request.file_write_max_threads, thread_name_prefix="ckpt-file") as pool:
            records = list(pool.map(lambda e: _write_entry(storage, root, request.rank, e), request.entries))
    else:
        records = [_write_entry(storage, root, request.rank, e) for e in request.entries]
    for directory in sorted(directories, key=lambda p: len(p.parts), reverse=True):
        storage.sync_directory(directory)
    return records


def _finalize(storage: Storage, request: WriteRequest, records: list[FileRecord]) -> None:
    """Rank 0: metadata, manifest, marker removal, fsync, atomic rename, fsync of the parent."""
    by_path: dict[str, FileRecord] = {}
    for rec in records:
        other = by_path.get(posixpath.normpath(rec.path))
        if other is not None:
            raise RuntimeError(
                f"Item '{other.key}' on rank {other.rank} and item '{rec.key}' on rank {rec.rank} both wrote "
                f"{rec.path!r}; put '{{rank}}' in the layout's file_path so that every rank has its own file."
            )
        by_path[posixpath.normpath(rec.path)] = rec
    root = Path(request.tmp_dir)
    if request.metadata_json is not None:
        storage.write(root / METADATA_JSON, request.metadata_json.encode("utf-8"))
    manifest = Manifest(
        request.world_size,
        __version__,
        tuple(records),
        METADATA_JSON if request.metadata_json else None,
        request.step,
        request.metrics,
        time.time(),
    )
    storage.write(root / MANIFEST_FILE_NAME, manifest.to_json().encode("utf-8"))
    storage.delete(root / INCOMPLETE_MARKER)
    storage.sync_directory(root)
    final = Path(request.checkpoint_dir)
    storage.replace_directory(root, final)
    storage.sync_directory(final.parent)


def write_checkpoint(storage: Storage, request: WriteRequest) -> None:
    """Write this rank's files and take part in the commit; returns once the checkpoint is durable.

    On failure the temporary directory is removed where this rank owns the outcome (single rank, or rank 0);
    it never reaches the checkpoint's path either way.
    """
    try:
        _write_and_commit(storage, request)
    except BaseException:
        if request.rank == 0:
            _discard(storage, Path(request.tmp_dir))
        raise
    if request.finalize_callback is not None:
        request.finalize_callback(request.checkpoint_dir, None)


def _discard(storage: Storage, tmp: Path) -> None:
    try:
        if storage.exists(tmp):
            storage.rmdir(tmp)
    except OSError:
        pass  # best effort: the marker still tells load() that this directory is not a checkpoint


def _write_and_commit(storage: Storage, request: WriteRequest) -> None:
    before_commit = request.pre_finalize_callback
    if request.store is None:
        records = _write_local_files(storage, request)
        if before_commit is not None:
            before_commit(request.checkpoint_dir, None)
        _finalize(storage, request, records)
        return
    channel = StoreChannel(request.store, request.timeout_s)
    try:
        local = [r.to_dict() for r in _write_local_files(storage, request)]
        if before_commit is not None:
            before_commit(request.checkpoint_dir, None)
        channel.publish(f"files/{request.rank}", json.dumps({"ok": local}))
    except BaseException as exc:
        channel.publish(f"files/{request.rank}", json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise
    if request.rank != 0:
        verdict = _await_verdict(channel, request.world_size)
        channel.publish(f"ack/{request.rank}", verdict)  # rank 0 hosts the store: it must outlive our read
        if verdict != "ok":
            raise RuntimeError(f"Checkpoint {request.checkpoint_dir} was not committed: {verdict}")
        return
    try:
        reports = [json.loads(s) for s in channel.gather("files", request.world_size, "its written files")]
        failed = {r: rep["error"] for r, rep in enumerate(reports) if "error" in rep}
        if failed:
            raise RuntimeError(f"rank(s) {sorted(failed)} failed to write their files: {failed}")
        records = [FileRecord.from_dict(d) for rep in reports for d in rep["ok"]]
        _finalize(storage, request, records)
    except BaseException as exc:
        channel.publish("commit", f"rank 0 could not commit: {type(exc).__name__}: {exc}")
        _await_acks(channel, request.world_size, timeout_s=_VERDICT_GRACE_S)
        raise
    channel.publish("commit", "ok")
    _await_acks(channel, request.world_size)


def _await_verdict(channel: StoreChannel, world_size: int) -> str:
    """Rank 0's verdict; if it never comes, name the ranks that did not report (or rank 0 itself)."""
    try:
        return channel.wait_for("commit", "rank 0", grace_s=_VERDICT_GRACE_S)
    except TimeoutError:
        silent = channel.missing("files", world_size)
        if silent:
            raise TimeoutError(
                f"Checkpoint commit: rank(s) {silent} did not report their written files within "
                f"{channel.timeout_s:.0f}s (a rank died, hung, or never called save()). No checkpoint was committed."
            ) from None
        raise


def _await_acks(channel: StoreChannel, world_size: int, timeout_s: float | None = None) -> None:
    """Rank 0 hosts the store: keep it up until every live rank has read the verdict."""
    channel.publish("ack/0", "self")
    try:
        channel.gather("ack", world_size, "that it saw the commit verdict", timeout_s=timeout_s)
    except TimeoutError:
        pass  # a rank that died after the verdict changes nothing about the committed checkpoint


@dataclass
class CheckpointWriterArgs:
    config: CheckpointWriterConfig
    rank_info: RankInfo
    storage_config: StorageConfig
    pre_finalize_callback: Callable[[str, Any], None] | None = None
    finalize_callback: Callable[[str, Any], None] | None = None
    metric_prefix: str = "train.checkpoint_write"

    def build(self) -> CheckpointWriter:
        return CheckpointWriter(self)


class CheckpointWriter:
    """A storage plus the callbacks to attach to each request."""

    TMP_PREFIX = "tmp_"

    def __init__(self, args: CheckpointWriterArgs) -> None:
        self.args = args
        self.storage = args.storage_config.create_storage()

    def write(self, request: WriteRequest) -> None:
        request.pre_finalize_callback = request.pre_finalize_callback or self.args.pre_finalize_callback
        request.finalize_callback = request.finalize_callback or self.args.finalize_callback
        write_checkpoint(self.storage, request)
