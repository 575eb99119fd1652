"""Object storage: time to a durable checkpoint on S3 vs a plain s3fs upload of the same bytes.

``python -m benchmarks.s3 [--size 64M] [--runs 3] [--endpoint http://host:port --bucket name]``

Without ``--endpoint`` a local moto server is started (checkout only: it comes from tests/s3_server.py), so the
figures measure the client side (encoding, checksums, part scheduling, commit requests) over loopback, not a
real network. Each row is the median of ``--runs``:

* ``s3fs open(wb)``: s3fs's own writer (multipart, parts uploaded one after another);
* ``s3fs pipe_file``: s3fs uploading one in-memory buffer (concurrent parts);
* ``FsspecStorage.stream_write``: this engine's writer (concurrent parts while the stream is written);
* ``save() to durable``: a sync ``CheckpointManager.save`` of a tensor of that size (torch.save encoding, CRC32,
  marker, upload, commit check, manifest), returning once the manifest is in the store;
* reads: s3fs ``cat_file`` vs ``FsspecStorage.read`` (concurrent ranged GETs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torch_checkpointing import CheckpointManager, FsspecStorageConfig, SyncCheckpointSaverConfig

MiB = 1 << 20


def _median_s(fn: Callable[[int], Any], runs: int) -> float:
    times = []
    for i in range(runs):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(config: FsspecStorageConfig, size: int, runs: int) -> list[tuple[str, float]]:
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


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="64M", help="bytes per upload: 64M, 1G, ... (default 64M)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--part-size", default="16M")
    p.add_argument("--endpoint", help="an S3 endpoint URL; default: start a local moto server")
    p.add_argument("--bucket", help="an existing bucket at --endpoint")
    args = p.parse_args()
    size, part = _parse_size(args.size), _parse_size(args.part_size)
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
        rows = run(config, size, args.runs)
    finally:
        if server is not None:
            server.stop()
    print(f"| {size // MiB} MiB, part {part // MiB} MiB, median of {args.runs} | seconds | MiB/s |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {size / MiB / seconds:.0f} |")


def _parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


if __name__ == "__main__":
    main()
