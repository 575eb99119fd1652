"""FsspecStorage against a real S3 API server (moto on loopback): names, multipart uploads, ranged reads, errors.

The server is started by the session fixture; nothing here mocks an S3 call. Where a test needs to see which
byte ranges were fetched, the storage is given an s3fs filesystem that records its ranged GETs (which still
happen), through `FsspecStorageConfig.filesystem`.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest

from tests.probes import modules_after
from tests.s3_server import TEST_PART_SIZE, RecordingStorageConfig, S3Server
from torch_checkpointing.errors import CheckpointError, ConfigError
from torch_checkpointing.manifest import MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import (
    FsspecStorage,
    FsspecStorageConfig,
    ObjectStoreError,
    url_scheme,
)

MIB = 1 << 20


@pytest.fixture
def storage(s3_server: S3Server) -> FsspecStorage:
    return s3_server.config().create_storage()


def _bucket(storage: FsspecStorage) -> str:
    return storage.config.url.removeprefix("s3://")


def _pending_uploads(storage: FsspecStorage) -> list[object]:
    return list(storage.fs.call_s3("list_multipart_uploads", Bucket=_bucket(storage)).get("Uploads", []))


# ------------------------------------------------------------------------------------------ config and names


def test_config_pickles_and_takes_its_protocol_from_the_url() -> None:
    config = FsspecStorageConfig(url="s3://bucket/runs", storage_options={"endpoint_url": "http://127.0.0.1:1"})
    assert config.protocol == "s3"
    assert pickle.loads(pickle.dumps(config)) == config
    assert FsspecStorageConfig.from_url("gs://b/run/step_1", token="anon").protocol == "gs"


def test_config_refusals_name_the_fix() -> None:
    with pytest.raises(ValueError, match="must be a URL"):
        FsspecStorageConfig(url="bucket/prefix")
    with pytest.raises(ValueError, match="at least"):
        FsspecStorageConfig(url="s3://b", part_size=MIB)
    with pytest.raises(ValueError, match="positive"):
        FsspecStorageConfig(url="s3://b", max_concurrency=0)


def test_url_scheme_recognises_ids_folded_by_pathlib() -> None:
    assert url_scheme("s3://b/run/step_1") == "s3"
    assert url_scheme(Path("s3://b/run/step_1")) == "s3"  # pathlib folds '//' into '/'
    assert url_scheme("/tmp/run/step_1") is None and url_scheme("run/step_1") is None
    config = FsspecStorageConfig(url="s3://b/root")
    assert config.handles("s3://b/x") and config.handles("relative/id") and not config.handles("gs://b/x")


def test_a_config_without_protocol_selects_the_store_by_each_ids_scheme(s3_server: S3Server) -> None:
    bucket = s3_server.config().url
    storage = FsspecStorageConfig(storage_options=s3_server.storage_options()).create_storage()
    assert storage.handles_url(f"{bucket}/run") and storage.handles_url("memory://x")
    storage.write(Path(f"{bucket}/run/a.bin"), b"on s3")
    assert storage.read(Path(f"{bucket}/run/a.bin")) == b"on s3"
    assert storage.remap_path(Path(f"{bucket}/run/a.bin")) == f"{bucket}/run/a.bin"
    with pytest.raises(ValueError, match="no URL scheme"):
        storage.read(Path("run/a.bin"))
    with pytest.raises(ValueError, match="single"):
        storage.fs  # noqa: B018
    assert not FsspecStorageConfig(url="s3://b").create_storage().handles_url("memory://x")


def test_importing_the_package_does_not_import_fsspec() -> None:
    loaded = modules_after("import torch_checkpointing")
    assert "torch_checkpointing" in loaded
    assert [m for m in loaded if m.split(".")[0] in ("fsspec", "s3fs")] == []


def test_paths_map_to_keys(storage: FsspecStorage) -> None:
    bucket = _bucket(storage)
    assert storage.remap_path(Path("run/a.pt")) == f"s3://{bucket}/run/a.pt"
    assert storage.remap_path(Path(f"s3://{bucket}/run/a.pt")) == f"s3://{bucket}/run/a.pt"
    with pytest.raises(ConfigError, match="absolute path"):  # not silently placed under the root (round 27)
        storage.remap_path(Path("/abs/a.pt"))
    with pytest.raises(ValueError, match="gs://"):
        storage.remap_path(Path("gs://other/a.pt"))
    rootless = FsspecStorage(FsspecStorageConfig(protocol="s3", storage_options=storage.config.storage_options))
    with pytest.raises(ValueError, match="no URL scheme"):
        rootless.remap_path(Path("run/a.pt"))


# ------------------------------------------------------------------------------------------ writes and reads


def test_a_given_filesystem_is_used_for_its_protocol() -> None:
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    config = FsspecStorageConfig(url="memory://given", filesystem=memory)
    storage = config.create_storage()
    assert storage.fs is memory and config.protocol == "memory"
    storage.write(Path("a.bin"), b"abc")
    assert memory.cat_file("/given/a.bin") == b"abc"
    assert pickle.loads(pickle.dumps(config)).create_storage().read(Path("a.bin")) == b"abc"
    with pytest.raises(ValueError, match=r"speaks \['memory'\], not the configured s3://"):
        FsspecStorageConfig(url="s3://bucket", filesystem=memory)


def test_large_file_is_a_multipart_upload_written_as_it_streams(storage: FsspecStorage) -> None:
    data = os.urandom(2 * TEST_PART_SIZE + 12345)
    path = Path("run/big.bin")
    with storage.stream_write(path) as stream:
        for start in range(0, len(data), MIB):
            stream.write(data[start : start + MIB])
            assert not storage.exists(path)  # invisible until close() completes the upload
    assert storage.getsize(path) == len(data)
    etag = storage.fs.info(storage.remap_path(path))["ETag"].strip('"')
    assert etag.endswith("-3")  # S3's multipart ETag: three parts
    assert storage.read(path) == data
    assert isinstance(storage.read(path), bytes)


def test_small_file_is_one_put(storage: FsspecStorage) -> None:
    storage.write(Path("run/small.json"), memoryview(b'{"a": 1}'))
    assert storage.read(Path("run/small.json")) == b'{"a": 1}'
    storage.write(Path("run/empty"), b"")
    assert storage.read(Path("run/empty")) == b"" and storage.getsize(Path("run/empty")) == 0


def test_write_of_large_data_goes_multipart(storage: FsspecStorage) -> None:
    data = os.urandom(TEST_PART_SIZE + 1)
    storage.write(Path("run/w.bin"), data)
    assert storage.read(Path("run/w.bin")) == data


def test_leaving_the_with_block_on_an_error_aborts_the_upload(storage: FsspecStorage) -> None:
    with pytest.raises(ValueError, match="encoder failed"), storage.stream_write(Path("run/half.bin")) as stream:
        stream.write(os.urandom(2 * TEST_PART_SIZE))
        raise ValueError("encoder failed")
    assert not storage.exists(Path("run/half.bin"))
    assert _pending_uploads(storage) == []  # no parts left behind


def _recording(storage: FsspecStorage) -> FsspecStorage:
    """A storage like `storage` that records the byte range of every GET it issues (the GETs are real)."""
    config = storage.config
    return RecordingStorageConfig(
        url=config.url, storage_options=config.storage_options, part_size=config.part_size
    ).create_storage()


def _ranges(recorder: FsspecStorage) -> list[tuple[int, int]]:
    return [(start, end) for _, start, end in recorder.gets]  # type: ignore[attr-defined]


def test_read_range_fetches_only_the_range_in_concurrent_parts(storage: FsspecStorage) -> None:
    data = os.urandom(4 * TEST_PART_SIZE)
    storage.write(Path("run/r.bin"), data)
    recorder = _recording(storage)
    offset, length = 1000, 2 * TEST_PART_SIZE + 7
    assert recorder.read_range(Path("run/r.bin"), offset, length) == data[offset : offset + length]
    gets = _ranges(recorder)
    assert min(s for s, _ in gets) == offset and max(e for _, e in gets) == offset + length
    assert sum(e - s for s, e in gets) == length  # no byte outside the range, none twice
    assert len(gets) == 3 and all(e - s <= TEST_PART_SIZE for s, e in gets)
    assert recorder.read_range(Path("run/r.bin"), 5, 0) == b""


def test_read_is_concurrent_ranged_gets(storage: FsspecStorage) -> None:
    data = os.urandom(3 * TEST_PART_SIZE)
    storage.write(Path("run/whole.bin"), data)
    recorder = _recording(storage)
    assert recorder.read(Path("run/whole.bin")) == data
    assert sorted(_ranges(recorder)) == [(i * TEST_PART_SIZE, (i + 1) * TEST_PART_SIZE) for i in range(3)]
    with recorder.stream_read(Path("run/whole.bin")) as stream:
        assert stream.read(10) == data[:10]


def test_local_path_is_none(storage: FsspecStorage) -> None:
    assert storage.local_path(Path("run/a")) is None
    assert storage.atomic_rename is False


# ------------------------------------------------------------------------------------------ listing, deletion


def test_listing_exists_isdir(storage: FsspecStorage) -> None:
    for name in ("ck/a.pt", "ck/sub/b.json", "ck2/c.pt"):
        storage.write(Path(name), b"x")
    storage.mkdir(Path("ck/never-needed"))  # a no-op on an object store
    assert storage.ls(Path("ck")) == ["a.pt", "sub"]
    assert storage.isdir(Path("ck")) and storage.isdir(Path("ck/sub")) and not storage.isdir(Path("ck/a.pt"))
    assert storage.exists(Path("ck/a.pt")) and not storage.exists(Path("ck/nope"))
    assert sorted(storage.glob("ck/*.pt")) == ["ck/a.pt"]
    with pytest.raises(FileNotFoundError):
        storage.read(Path("ck/nope"))


def test_rmdir_removes_only_that_prefix(storage: FsspecStorage) -> None:
    for name in ("run/step_1/a", "run/step_1/sub/b", "run/step_10/a", "run/step_1.json"):
        storage.write(Path(name), b"x")
    storage.rmdir(Path("run/step_1"))
    assert not storage.exists(Path("run/step_1/a")) and not storage.exists(Path("run/step_1/sub/b"))
    assert storage.exists(Path("run/step_10/a")) and storage.exists(Path("run/step_1.json"))
    storage.rmdir(Path("run/none"))  # nothing there: no error
    storage.delete(Path("run/step_10/a"))
    assert not storage.exists(Path("run/step_10/a"))


def test_directory_rename_copies_the_manifest_last_and_replace_refuses_a_committed_one(storage: FsspecStorage) -> None:
    storage.write(Path("tmp/a.pt"), b"A")
    storage.write(Path("tmp") / MANIFEST_FILE_NAME, b"{}")
    storage.replace_directory(Path("tmp"), Path("ck"))
    assert storage.read(Path("ck/a.pt")) == b"A" and storage.exists(Path("ck") / MANIFEST_FILE_NAME)
    assert not storage.exists(Path("tmp/a.pt"))
    storage.write(Path("tmp2/a.pt"), b"B")
    with pytest.raises(CheckpointError, match="Refusing to overwrite"):
        storage.replace_directory(Path("tmp2"), Path("ck"))
    assert storage.read(Path("ck/a.pt")) == b"A"
    storage.rename(Path("tmp2/a.pt"), Path("tmp3/a.pt"))
    assert storage.read(Path("tmp3/a.pt")) == b"B" and not storage.exists(Path("tmp2/a.pt"))


# ------------------------------------------------------------------------------------------ failures


def test_failed_upload_raises_a_named_error_and_the_storage_stays_usable(s3_server: S3Server) -> None:
    good = s3_server.config().create_storage()
    missing = s3_server.config(bucket="no-such-bucket").create_storage()
    with pytest.raises(ObjectStoreError, match=re.escape("s3://no-such-bucket/run/a.json")):
        missing.write(Path("run/a.json"), b"{}")
    big = re.escape("upload of s3://no-such-bucket/run/big.bin")
    with pytest.raises(ObjectStoreError, match=big), missing.stream_write(Path("run/big.bin")) as stream:
        stream.write(os.urandom(2 * TEST_PART_SIZE))
    assert isinstance(ObjectStoreError("x"), CheckpointError)
    good.write(Path("run/a.json"), b"{}")
    assert good.read(Path("run/a.json")) == b"{}"


def test_the_resharding_source_reader_fetches_only_the_rows_it_needs(storage: FsspecStorage) -> None:
    """A safetensors source on S3 is opened through `read_range`: a block read is one small ranged GET."""
    import torch
    from safetensors.torch import save as safetensors_save

    from torch_checkpointing.checkpoint_layout import SafetensorsSerialization
    from torch_checkpointing.source_reader import ReadStats, open_source_file

    full = torch.arange(4096 * 256, dtype=torch.float32).reshape(4096, 256)  # 4 MiB
    storage.write(Path("src/model.safetensors"), safetensors_save({"w": full}))
    recorder = _recording(storage)
    stats = ReadStats()
    source = open_source_file(recorder, Path("src/model.safetensors"), SafetensorsSerialization(), stats)
    handle = source.tensor(("w",))
    assert handle is not None
    block = handle.read_block((1024, 0), (16, 256), stats)
    assert torch.equal(block, full[1024:1040])
    fetched = sum(e - s for s, e in _ranges(recorder))
    assert fetched < 16 * 256 * 4 + 4096  # the 16 rows and the header, not the 4 MiB file


def test_memory_is_bounded_by_parts_in_flight_not_by_the_file(s3_server: S3Server) -> None:
    """Uploading 16 parts keeps a few parts in memory (the in-flight ones and the HTTP client's copies of them),
    never a copy of the whole file; a download holds the result plus the parts in flight."""
    import tracemalloc

    storage = s3_server.config(max_concurrency=2).create_storage()
    data = os.urandom(16 * TEST_PART_SIZE)
    view = memoryview(data)
    tracemalloc.start()
    try:
        with storage.stream_write(Path("mem/big.bin")) as stream:
            for start in range(0, len(data), 8 * MIB):
                stream.write(view[start : start + 8 * MIB])
        _, upload_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert storage.read(Path("mem/big.bin")) == data
        _, download_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert upload_peak < 10 * TEST_PART_SIZE, upload_peak / MIB  # measured ~7.5 parts; the file is 16
    assert download_peak < len(data) + 6 * TEST_PART_SIZE, download_peak / MIB  # the result + parts in flight


def test_a_file_over_the_part_limit_fails_clearly_and_leaves_nothing(
    storage: FsspecStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch_checkpointing.storage import fsspec_storage

    monkeypatch.setattr(fsspec_storage, "MAX_PARTS", 2)
    too_big = pytest.raises(ObjectStoreError, match=r"raise FsspecStorageConfig\.part_size")
    with too_big, storage.stream_write(Path("run/too-big.bin")) as stream:
        stream.write(os.urandom(3 * TEST_PART_SIZE))
    assert not storage.exists(Path("run/too-big.bin"))
    assert _pending_uploads(storage) == []
