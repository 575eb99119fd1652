"""Round 17 attacks on the object-store backend, against a real S3 server (moto on loopback, tests/s3_server.py).

* A user's folder under a run whose `.incomplete` is another program's file (a download tool's progress, neither
  empty nor a save's claim): gc deleted it with the user's files (on S3 any `.incomplete` made a prefix "an
  unfinished save of ours" whose claim was "dead"), and a save of that id took it over and wrote among them.
  Such a file may be large: the save's claim check and gc read at most a claim's worth of it. Likewise a
  user's prefix named like one of our trash prefixes that holds another tool's `manifest.json`: gc deleted it.
* A client that cannot reach or configure the store: an endpoint that refuses connections, an `endpoint_url`
  without its scheme, an option s3fs does not take. The error was botocore's or aiohttp's text alone
  ("Could not connect to the endpoint URL", "Invalid endpoint", "AioSession.__init__() got an unexpected
  keyword argument"), naming no fix; a scheme-less endpoint surfaced only at the first request.
* The commit's last step, the DELETE of the `.incomplete` marker, failing: refused (a 5xx), the failed save left
  its manifest beside its claim, so loads called the id incomplete while the next save of it was refused ("a
  checkpoint already exists there") until gc outlived the process; answered with an error after the store had
  deleted it (a dropped connection), the save raised although its checkpoint was committed and loaded. The
  manifest's conditional create whose answer was lost and which the client retried met its own manifest and
  failed the save as "another save committed this checkpoint while this one ran".
* Ids holding `*`, `?` or `[` (`run/step*1`): a retention delete (a copy to a trash name, then a delete) went
  through fsspec's `copy`, which expands them as a glob: it copied the objects of every checkpoint the pattern
  matched into nested keys under the trash and the id, and one with `[` failed and left a trash prefix behind.
  An id holding `?versionId=` named another object altogether (s3fs drops it and all after it: `run/step`).
  On a directory store through fsspec (memory://), removing `run/step*1` removed `run/stepX1` too.
* A crafted manifest on S3 whose record names a format no load reads (`{"type": "os.system"}`): a load raised
  the engine's ConfigError "Unknown SerializationFormat type" (a ValueError, no CheckpointError), naming no file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import s3fs

from tests.memory_storage import free_port
from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import RecordingStorageConfig, S3Server
from tests.test_s3_attacks import BOUND_S, fast_failing, state, sync_manager, through_proxy
from torch_checkpointing.discovery import latest_checkpoint, list_checkpoints, list_leftovers
from torch_checkpointing.errors import (
    CommitError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ObjectStoreError,
)
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.retention import collect_garbage, delete_checkpoint
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

# ------------------------------------------------------------------------------------ foreign objects under a run


def test_a_users_folder_with_another_programs_incomplete_file_is_never_collected_or_saved_into(
    s3_server: S3Server,
) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    user = {"run/downloads/.incomplete": b"downloaded 45% of dataset.tar", "run/downloads/dataset.tar.part": b"x" * 64}
    for key, data in user.items():
        storage.write(Path(key), data)
    (leftover,) = list_leftovers(f"{config.url}/run", storage)
    assert not leftover.recognised, leftover
    report = collect_garbage(f"{config.url}/run", storage)
    assert not report.removed and not report.failed, report
    assert "not a marker of ours" in report.kept[0][1]
    with sync_manager(config) as manager, pytest.raises(CommitError, match="not a marker of ours"):
        manager.save("run/downloads", state(2.0))
    for key, data in user.items():  # every byte of the user's folder is still there, and nothing else
        assert storage.read(Path(key)) == data, key
    assert sorted(storage.ls(Path("run/downloads"))) == [".incomplete", "dataset.tar.part"]
    with sync_manager(config) as manager:
        assert float(manager.load("run/step_1")["model"]["w"][0]) == 1.0


def test_a_trash_named_prefix_holding_another_tools_manifest_is_never_collected(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    user = {
        "run/.ext.trash-3999999-abcd/manifest.json": b'{"manifest_version": 3, "name": "my extension"}',
        "run/.ext.trash-3999999-abcd/background.js": b"console.log(1)",
    }
    for key, data in user.items():
        storage.write(Path(key), data)
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0)
    assert not report.removed and not report.failed, report
    for key, data in user.items():
        assert storage.read(Path(key)) == data, key


def test_a_large_foreign_incomplete_file_is_refused_after_reading_a_claims_worth(s3_server: S3Server) -> None:
    base = s3_server.config()
    config = RecordingStorageConfig(url=base.url, storage_options=base.storage_options, part_size=base.part_size)
    storage = config.create_storage()
    big = b"partial download " * (3 << 20 >> 4)  # 3 MiB of another program's bytes
    storage.write(Path("run/dl/.incomplete"), big)
    with sync_manager(config) as manager, pytest.raises(CommitError, match="not a marker of ours"):
        manager.save("run/dl", state(1.0))
    report = collect_garbage(f"{config.url}/run", storage)
    assert not report.removed and storage.read(Path("run/dl/.incomplete")) == big
    fetched = [end - start for key, start, end in config.filesystem.gets if key.endswith("run/dl/.incomplete")]
    assert fetched and max(fetched[:-1]) <= (64 << 10) + 1, fetched  # the last GET is the test's own read


# ------------------------------------------------------------------------------ a client that cannot reach the store


def test_an_unreachable_endpoint_or_an_unknown_option_fails_naming_the_fix(s3_server: S3Server) -> None:
    bucket = s3_server.config().url
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cases = {
        "refused": (fast_failing(s3_server.storage_options(), closed), "AWS_ENDPOINT_URL or storage_options"),
        "unknown option": ({**s3_server.storage_options(), "endpoint": closed}, "storage_options holds an option"),
    }
    for name, (options, fix) in cases.items():
        config = FsspecStorageConfig(url=bucket, storage_options=options, part_size=s3_server.config().part_size)
        with sync_manager(config) as manager:
            start = time.monotonic()
            with pytest.raises(ObjectStoreError) as caught:
                manager.save("run/step_1", state(1.0))
            assert time.monotonic() - start < BOUND_S, name
        assert f"{bucket}/run/step_1" in str(caught.value) and fix in str(caught.value), (name, str(caught.value))
    for options in ({"endpoint_url": "127.0.0.1:9000"}, {"client_kwargs": {"endpoint_url": "minio:9000"}}):
        with pytest.raises(ConfigError, match=r"endpoint_url'\] must be a URL with its scheme"):
            FsspecStorageConfig(url=bucket, storage_options=options)


# ------------------------------------------------------------------------------ the commit's last step failing


def _w(loaded: Any) -> float:
    return float(loaded["model"]["w"][0])


def test_a_refused_removal_of_the_marker_fails_the_save_and_leaves_the_id_to_the_next_save(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with (
        FaultProxy(s3_server.port) as proxy,
        sync_manager(through_proxy(config, proxy)) as manager,
    ):
        manager.save("run/step_1", state(1.0))
        proxy.rules = [Rule(r"^DELETE \S*/run/step_2/\.incomplete", 500, "InternalError")]
        with pytest.raises(ObjectStoreError, match=r"run/step_2/\.incomplete"):
            manager.save("run/step_2", state(2.0))
        proxy.rules = []
        assert not storage.exists(Path("run/step_2") / MANIFEST_FILE_NAME)  # before: the manifest stayed
        with pytest.raises(IncompleteCheckpointError):
            manager.load("run/step_2")
        assert [c.name for c in list_checkpoints(f"{config.url}/run", storage)] == ["step_1"]
        manager.save("run/step_2", state(3.0))  # before: "a checkpoint already exists there", in this process
        assert _w(manager.load("run/step_2")) == 3.0 and _w(manager.load("run/step_1")) == 1.0


class _DeletesThenDrops(s3fs.S3FileSystem):  # type: ignore[misc]
    """Deletes `.incomplete` markers on the server, then answers as if the connection dropped."""

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        await super()._rm_file(path, **kwargs)
        if path.endswith(f"/{INCOMPLETE_MARKER}"):
            raise ConnectionResetError("connection reset after the request was sent")


def test_a_marker_removal_whose_answer_is_lost_is_a_commit_not_a_failure(s3_server: S3Server) -> None:
    base = s3_server.config()
    config = FsspecStorageConfig(
        url=base.url,
        part_size=base.part_size,
        storage_options=base.storage_options,
        filesystem=_DeletesThenDrops(**base.storage_options),
    )
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))  # before: ObjectStoreError, for a checkpoint that loads
        assert _w(manager.load("run/step_1")) == 1.0
    storage = base.create_storage()
    assert not storage.exists(Path("run/step_1") / INCOMPLETE_MARKER)
    assert [c.name for c in list_checkpoints(f"{base.url}/run", storage)] == ["step_1"]


class _PutsThenDrops(s3fs.S3FileSystem):  # type: ignore[misc]
    """Creates manifests on the server, then answers as if the connection dropped (the client retries)."""

    async def _pipe_file(self, path: str, data: bytes, **kwargs: Any) -> Any:
        out = await super()._pipe_file(path, data, **kwargs)
        if path.endswith(f"/{MANIFEST_FILE_NAME}"):
            raise ConnectionResetError("connection reset after the request was sent")
        return out


def test_a_manifest_upload_whose_answer_is_lost_is_not_taken_for_another_saves(s3_server: S3Server) -> None:
    base = s3_server.config()
    config = FsspecStorageConfig(
        url=base.url,
        part_size=base.part_size,
        storage_options=base.storage_options,
        filesystem=_PutsThenDrops(**base.storage_options),
    )
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))  # before: ObjectStoreError, and the id left incomplete
        assert _w(manager.load("run/step_1")) == 1.0
    storage = base.create_storage()
    assert [c.name for c in list_checkpoints(f"{base.url}/run", storage)] == ["step_1"]


# ------------------------------------------------------------------------------------------- crafted manifests


@pytest.mark.parametrize("fmt", [{"type": "os.system"}, {"type": None}, {}])
def test_a_manifest_recording_a_format_no_load_reads_is_refused_naming_the_file(
    s3_server: S3Server, fmt: dict[str, Any]
) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
        manifest = json.loads(storage.read(Path("run/step_1/manifest.json")))
        manifest["items"]["model"]["0"]["format"] = fmt
        storage.delete(Path("run/step_1/manifest.json"))
        storage.write(Path("run/step_1/manifest.json"), json.dumps(manifest).encode())
        with pytest.raises(
            CorruptCheckpointError,
            match=r"run/step_1/manifest\.json: field 'items\.model\.0\.format' \(file 'model_0\.pt'\)",
        ):
            manager.load("run/step_1")
    latest = latest_checkpoint(f"{config.url}/run", storage)  # never a resume point that no load reads
    assert latest is None, latest


# ------------------------------------------------------------------------------------------- odd characters in ids


def test_ids_with_glob_characters_are_deleted_alone_and_a_version_marker_is_refused(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    bucket = config.url.split("://", 1)[1]
    globs = {"r/step*1": 1.0, "r/step?1": 2.0, "r/step[1]": 3.0}
    matched = {"r/stepX1": 4.0, "r/step1": 5.0, "r/stepYY1": 6.0}  # what the patterns match as globs
    with sync_manager(config) as manager:
        for ckpt_id, seed in {**globs, **matched}.items():
            manager.save(ckpt_id, state(seed))
        before = {k: storage.read(Path(k.split("/", 1)[1])) for k in storage.fs.find(f"{bucket}/r/step1")}
        for ckpt_id in globs:
            assert delete_checkpoint(f"{config.url}/{ckpt_id}", storage), ckpt_id
        left = sorted(storage.fs.find(f"{bucket}/r"))
        expected = sorted(f"{bucket}/{i}/{f}" for i in matched for f in ("manifest.json", "meta_0.pt", "model_0.pt"))
        assert left == expected, left  # nothing copied into other names, no trash left, nothing else deleted
        for ckpt_id, seed in matched.items():
            assert _w(manager.load(ckpt_id)) == seed, ckpt_id
        assert {k: storage.read(Path(k.split("/", 1)[1])) for k in storage.fs.find(f"{bucket}/r/step1")} == before
        with pytest.raises(ConfigError, match="versionId"):  # it would land on the object r/step
            storage.write(Path("r/step?versionId=1/x"), b"data")
    user = FsspecStorage(FsspecStorageConfig(protocol="s3", storage_options=s3_server.storage_options()))
    user.fs.call_s3("put_object", Bucket=bucket, Key="r/step?versionId=2", Body=b"a user's object")  # raw
    storage.write(Path("r/step"), b"another user's object")
    with sync_manager(config) as manager:
        with pytest.raises((ConfigError, CommitError)):
            manager.save("r/step?versionId=1", state(7.0))
        assert storage.read(Path("r/step")) == b"another user's object"
        names = sorted(c.name for c in list_checkpoints(f"{config.url}/r", storage))  # a listing takes the odd key
        assert names == ["step1", "stepX1", "stepYY1"], names


@pytest.mark.parametrize("root", ["memory://r17-globs", "file"])
def test_removing_a_glob_named_id_on_a_directory_store_removes_it_alone(root: str, tmp_path: Path) -> None:
    """fsspec's `rm(recursive=True)` expands the name as a glob: removing `run/step*1` removed `run/stepX1`."""
    url = root if root.startswith("memory") else f"file://{tmp_path}/run"
    config = FsspecStorageConfig(url=url)
    storage = config.create_storage()
    with sync_manager(config) as manager:
        for ckpt_id, seed in (("r/step*1", 1.0), ("r/stepX1", 2.0), ("r/step11", 3.0)):
            manager.save(ckpt_id, state(seed))
        storage.rmdir(Path("r/step*1"))
        assert not storage.exists(Path("r/step*1"))
        assert _w(manager.load("r/stepX1")) == 2.0 and _w(manager.load("r/step11")) == 3.0
