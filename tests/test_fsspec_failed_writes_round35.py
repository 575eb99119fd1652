"""A write that fails leaves no object under its name, on every fsspec filesystem.

* `memory://` commits a file at its open (fsspec's `MemoryFile`), and its `discard()` is a no-op that raised
  nothing: the stream took that for a dropped upload, and the bytes written before the failure stayed under
  the file's name, a partial object that listings and loads took for whole.
* A store whose fsspec file is buffered (`AbstractBufferedFile`: s3fs's, gcsfs', adlfs') was told `discard()`
  and then left open: its finalizer's `close()` flushed the dropped buffer (an upload of the partial bytes
  where the store's discard does not empty it; on s3fs a traceback on stderr, "Exception ignored in").
"""

from __future__ import annotations

import gc
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.s3_server import S3Server
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig, _FsspecFileWriter


class _EncoderFailed(RuntimeError):
    pass


def _fail_midway(storage: FsspecStorage, name: str) -> None:
    with pytest.raises(_EncoderFailed), storage.stream_write(Path(name)) as stream:
        stream.write(b"x" * 100)
        raise _EncoderFailed("the encoder failed after its first bytes")


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_a_failed_stream_leaves_nothing_under_its_name(scheme: str, tmp_path: Path) -> None:
    root = f"memory://round35-{uuid.uuid4().hex}" if scheme == "memory" else f"file://{tmp_path}"
    storage = FsspecStorage(FsspecStorageConfig(url=root))
    storage.mkdir(Path("step_1"))
    _fail_midway(storage, "step_1/model.bin")
    assert not storage.exists(Path("step_1/model.bin")), storage.ls(Path("step_1"))
    assert storage.ls(Path("step_1")) == []


def test_a_dropped_buffered_upload_is_not_flushed_when_collected(s3_server: S3Server) -> None:
    import s3fs

    bucket = s3_server.config().url.removeprefix("s3://")
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    unraisable: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        writer = _FsspecFileWriter(fs, f"{bucket}/model.bin", 5 << 20, f"s3://{bucket}/model.bin")
        with pytest.raises(_EncoderFailed), writer:
            writer.write(b"x" * 100)
            raise _EncoderFailed("the encoder failed after its first bytes")
        del writer
        gc.collect()
    finally:
        sys.unraisablehook = hook
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/model.bin")
    assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable] == []


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_a_stream_dropped_unclosed_leaves_nothing_under_its_name(scheme: str, tmp_path: Path) -> None:
    """`io.IOBase`'s finalizer closes a stream, and the close finished the file: a stream a caller dropped
    without closing it (its own error, outside any `with`) left its bytes so far as a whole object. S3's
    stream aborts there; every fsspec stream now discards."""
    root = f"memory://round35-{uuid.uuid4().hex}" if scheme == "memory" else f"file://{tmp_path}"
    storage = FsspecStorage(FsspecStorageConfig(url=root))
    storage.mkdir(Path("step_1"))
    stream = storage.stream_write(Path("step_1/model.bin"))
    stream.write(b"x" * 100)
    del stream
    gc.collect()
    assert not storage.exists(Path("step_1/model.bin")), storage.ls(Path("step_1"))
