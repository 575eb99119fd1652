"""Object storage: time to a durable checkpoint on S3 vs a plain s3fs upload of the same bytes, and the bytes a
verified resharding load fetches vs the bytes it needs.

``python -m benchmarks.s3 [--size 64M] [--runs 3] [--reshard-size 256M] [--endpoint http://host:port --bucket name]``

Without ``--endpoint`` a local moto server is started (checkout only: it comes from tests/s3_server.py), so the
figures measure the client side (encoding, checksums, part scheduling, commit requests) over loopback, not a
real network. Each row is the median of ``--runs``:

* ``s3fs open(wb)``: s3fs's own writer (multipart, parts uploaded one after another);
* ``s3fs pipe_file``: s3fs uploading one in-memory buffer (concurrent parts);
* ``FsspecStorage.stream_write``: this engine's writer (concurrent parts while the stream is written);
* ``save() to durable``: a sync ``CheckpointManager.save`` of a tensor of that size (torch.save encoding, CRC32,
  marker, upload, commit check, manifest), returning once the manifest is in the store;
* reads: s3fs ``cat_file`` vs ``FsspecStorage.read`` (concurrent ranged GETs);
* reshard 4->8: DTensor state (the reshard section's tensors, safetensors layout) saved by 4 gloo ranks, loaded
  by 8 with verification on (the default); each rank counts every byte its storage's reads returned (manifest,
  metadata and source files; `CountingStorage` over the public `Storage` API: on S3 each read is GETs of exactly
  those bytes) against the bytes of its shard.

The two targets (durable / best plain s3fs upload <= 1.2x; bytes fetched / needed <= 1.1x, worst rank) are
defined in benchmarks/report.py; this module's ``run(cfg, workdir)`` is the ``s3`` section's entry point.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Buffer

from torch_checkpointing import CheckpointManager, FsspecStorageConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from .config import BenchConfig

MiB = 1 << 20
# moto is a single Python process: it takes 10+ minutes for 1 GiB uploads x 3 ways x the runs. The ratios are
# against plain s3fs through the same server, so a smaller upload keeps them meaningful.
SECTION_MAX_BYTES = 256 * MiB


def _median_s(fn: Callable[[int], Any], runs: int) -> float:
    times = []
    for i in range(runs):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_uploads(config: FsspecStorageConfig, size: int, runs: int) -> list[tuple[str, float]]:
    storage = config.create_storage()
    fs, bucket = storage.fs, config.url.removeprefix("s3://")
    data = os.urandom(size)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    tag = uuid.uuid4().hex[:8]

    def s3fs_open(i: int) -> None:
        with fs.open(f"{bucket}/{tag}/open_{i}", "wb", block_size=config.part_size) as f:
            f.write(data)

    def s3fs_pipe(i: int) -> None:
        fs.pipe_file(f"{bucket}/{tag}/pipe_{i}", data, chunksize=config.part_size)

    def engine_stream(i: int) -> None:
        with storage.stream_write(Path(f"{tag}/stream_{i}")) as stream:
            stream.write(data)

    manager = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config))

    def engine_save(i: int) -> None:
        manager.save(f"{tag}/ckpt/step_{i}", {"model": {"w": tensor}})

    try:
        rows = [
            ("s3fs open(wb) upload", _median_s(s3fs_open, runs)),
            ("s3fs pipe_file upload", _median_s(s3fs_pipe, runs)),
            ("FsspecStorage.stream_write upload", _median_s(engine_stream, runs)),
            ("CheckpointManager.save() to durable", _median_s(engine_save, runs)),
            ("s3fs cat_file download", _median_s(lambda i: fs.cat_file(f"{bucket}/{tag}/pipe_0"), runs)),
            ("FsspecStorage.read download", _median_s(lambda i: storage.read(Path(f"{tag}/pipe_0")), runs)),
        ]
    finally:
        manager.close()
        storage.rmdir(Path(tag))
    return rows


# ------------------------------------------------------------------------------------------ reshard 4 -> 8


@dataclass
class CountingStorageConfig(StorageConfig):
    """`inner`'s storage, counting the bytes its reads return (`fetched`): every storage built from this config
    in this process is a `CountingStorage` over one `inner` builds."""

    inner: StorageConfig

    def __post_init__(self) -> None:
        self._built: list[CountingStorage] = []

    def create_storage(self) -> CountingStorage:
        storage = CountingStorage(self.inner.create_storage())
        self._built.append(storage)
        return storage

    @property
    def fetched(self) -> int:
        """The bytes read through every storage this config built in this process."""
        return sum(storage.fetched for storage in self._built)


class CountingStorage(Storage):
    """A storage that hands every call to `inner` (the public `Storage` methods, each forwarded, so none falls
    back to a base default) and counts the bytes `read`, `read_range` and `stream_read`'s streams return: the
    store's GETs, measured on the public API rather than inside the engine's S3 storage."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.atomic_rename = inner.atomic_rename
        self._fetched = 0
        self._lock = threading.Lock()  # ranged reads run in the loader's threads

    @property
    def fetched(self) -> int:
        return self._fetched

    def _count(self, data: bytes) -> bytes:
        with self._lock:
            self._fetched += len(data)
        return data

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        return self._count(self.inner.read(path, read_args))

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        return self._count(self.inner.read_range(path, offset, length))

    def read_sized(self, path: Path, limit: int) -> tuple[int, bytes | None]:
        size, data = self.inner.read_sized(path, limit)
        return size, None if data is None else self._count(data)

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        return _CountingReader(self.inner.stream_read(path, read_args), self._count)

    def stream_write(self, path: Path) -> io.IOBase:
        return self.inner.stream_write(path)

    def write(self, path: Path, data: Buffer) -> None:
        self.inner.write(path, data)

    def delete(self, path: Path) -> None:
        self.inner.delete(path)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        self.inner.mkdir(path, recursive)

    def rmdir(self, path: Path) -> None:
        self.inner.rmdir(path)

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        is_cross_link: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        self.inner.rename(src_path, dst_path, is_directory, is_cross_link, background_cleanup)

    def ls(self, path: Path) -> list[str]:
        return self.inner.ls(path)

    def exists(self, path: Path) -> bool:
        return self.inner.exists(path)

    def getsize(self, path: Path) -> int:
        return self.inner.getsize(path)

    def isdir(self, path: Path) -> bool:
        return self.inner.isdir(path)

    def remap_path(self, path: Path) -> str:
        return self.inner.remap_path(path)

    def tree_bytes(self, path: Path) -> int:
        return self.inner.tree_bytes(path)

    def local_path(self, path: Path) -> str | None:
        return self.inner.local_path(path)

    def is_link(self, path: Path) -> bool:
        return self.inner.is_link(path)

    def process_local(self, path: Path) -> bool:
        return self.inner.process_local(path)

    def changed_at(self, path: Path) -> float | None:
        return self.inner.changed_at(path)

    def store_now(self, folder: Path) -> float:
        return self.inner.store_now(folder)

    def is_irregular(self, path: Path) -> bool:
        return self.inner.is_irregular(path)

    def mapped_path(self, path: Path) -> str | None:
        return self.inner.mapped_path(path)

    def verify_range(self, path: Path, offset: int, length: int) -> None:
        self.inner.verify_range(path, offset, length)

    def handles_url(self, checkpoint_id: str) -> bool:
        return self.inner.handles_url(checkpoint_id)

    def sync_directory(self, path: Path) -> None:
        self.inner.sync_directory(path)

    def replace_directory(self, src: Path, dst: Path) -> None:
        self.inner.replace_directory(src, dst)

    def glob(self, pattern: str) -> list[str]:
        return self.inner.glob(pattern)


class _CountingReader(io.RawIOBase):
    """`inner` as a raw stream, handing each chunk it returns to `count`."""

    def __init__(self, inner: io.RawIOBase, count: Callable[[bytes], bytes]) -> None:
        super().__init__()
        self._inner, self._counted = inner, count

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Buffer) -> int:
        view = memoryview(buffer).cast("B")
        data = self._counted(self._inner.read(len(view)) or b"")
        view[: len(data)] = data
        return len(data)

    def seekable(self) -> bool:
        return self._inner.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()


def _reshard_items() -> dict[str, Any]:
    from torch_checkpointing import ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
    from torch_checkpointing.dtensor_resharder import DTensorResharder

    layout = LayoutInfo("model/{rank}.safetensors", SafetensorsSerialization())
    return {"model": ItemSpec(resharder=DTensorResharder(), layout=layout)}


def _rank_save(config: FsspecStorageConfig, ckpt: str, total: int) -> None:
    from .reshard import _model, global_specs

    conf = CheckpointManager.Config(items=_reshard_items(), save=SyncCheckpointSaverConfig(), storage_config=config)
    with CheckpointManager(conf) as manager:
        manager.save(ckpt, {"model": _model(global_specs(total), fill=True)})


def _rank_load(config: CountingStorageConfig, ckpt: str, total: int) -> dict[str, int]:
    """One verified load (the default); the bytes this rank fetched and the bytes of its shard."""
    import torch.distributed as dist

    from .reshard import _check, _model, global_specs

    specs = global_specs(total)
    conf = CheckpointManager.Config(items=_reshard_items(), save=SyncCheckpointSaverConfig(), storage_config=config)
    with CheckpointManager(conf) as manager:
        templates = _model(specs, fill=False)
        manager.load(ckpt, into={"model": templates})
    fetched = config.fetched
    _check(templates, specs, "reshard")
    needed = sum(t.to_local().numel() * t.to_local().element_size() for t in templates.values())
    dist.barrier()
    return {"fetched": fetched, "needed": needed}


def run_reshard(config: FsspecStorageConfig, total: int, timeout_s: float = 600.0) -> list[dict[str, int]]:
    """4 ranks save, 8 ranks load (verified); per rank {"fetched", "needed"}."""
    from simulator.launcher import launch

    ckpt = f"reshard-{uuid.uuid4().hex[:8]}/step_1"
    launch(_rank_save, 4, args=(config, ckpt, total), timeout=timeout_s / 2)
    counting = CountingStorageConfig(config)
    try:
        return launch(_rank_load, 8, args=(counting, ckpt, total), timeout=timeout_s / 2)
    finally:
        config.create_storage().rmdir(Path(ckpt).parent)


# ------------------------------------------------------------------------------------------ the section


def run(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    """The ``s3`` section: a local moto server, uploads of ``cfg.size_bytes`` (at most `SECTION_MAX_BYTES`) and the
    4->8 reshard."""
    from tests.s3_server import missing_s3_packages, start_s3_server

    missing = missing_s3_packages()
    if missing:
        return {"not_measured": f"needs {', '.join(missing)} (pip install -e '.[test]')"}

    workdir.mkdir(parents=True, exist_ok=True)
    size = min(cfg.size_bytes, SECTION_MAX_BYTES)
    server = start_s3_server(str(workdir))
    try:
        config = server.config(part_size=16 * MiB)
        rows = dict(run_uploads(config, size, cfg.runs))
        ranks = run_reshard(config, cfg.reshard_bytes, cfg.section_timeout_s / 2)
    finally:
        server.stop()
    return _result(size, rows, ranks, cfg.reshard_bytes)


def _result(size: int, uploads: dict[str, float], ranks: list[dict[str, int]] | None, total: int) -> dict[str, Any]:
    """The section's result, as the report's s3 rows read it (the runner's section and `main()` alike)."""
    return {
        "size": size,
        "durable_s": uploads["CheckpointManager.save() to durable"],
        "s3fs_best_s": min(uploads["s3fs open(wb) upload"], uploads["s3fs pipe_file upload"]),
        "uploads": uploads,
        "reshard": ranks,
        "reshard_total": total,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="64M", help="bytes per upload: 64M, 1G, ... (default 64M)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--part-size", default="16M")
    p.add_argument("--reshard-size", default="256M", help="global state of the 4->8 reshard (default 256M; 0: skip)")
    p.add_argument("--endpoint", help="an S3 endpoint URL; default: start a local moto server")
    p.add_argument("--bucket", help="an existing bucket at --endpoint")
    args = p.parse_args()
    size, part, total = _parse_size(args.size), _parse_size(args.part_size), _parse_size(args.reshard_size)
    server = None
    if args.endpoint is None:
        from tests.s3_server import start_s3_server

        server = start_s3_server(tempfile.mkdtemp(prefix="bench-moto-"))
        config = server.config(part_size=part)
    else:
        config = FsspecStorageConfig(
            url=f"s3://{args.bucket}", storage_options={"endpoint_url": args.endpoint}, part_size=part
        )
    try:
        rows = run_uploads(config, size, args.runs)
        ranks = run_reshard(config, total) if total else None
    finally:
        if server is not None:
            server.stop()
    print(f"| {size // MiB} MiB, part {part // MiB} MiB, median of {args.runs} | seconds | MiB/s |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {size / MiB / seconds:.0f} |")
    from .report import S3_RATIO_SPECS, compute_ratios, format_table

    verdicts = compute_ratios({"s3": {"result": _result(size, dict(rows), ranks, total)}}, S3_RATIO_SPECS)
    print()
    print(format_table(verdicts))


def _parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


if __name__ == "__main__":
    main()
