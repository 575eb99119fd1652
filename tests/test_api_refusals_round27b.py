"""Round 27: public-API refusals that gave bare internals or a silent surprise, and a barrier whose housekeeping
decided its outcome.

* `TCPStoreBarrier`: role rank 0 removed the earlier rounds' keys from its store before deciding the round; a
  removal that stalled spent its channel, so rank 0 raised while every other rank passed the same round.
* An absolute id under an fsspec `url` root (`/abs/c3` under `memory://b2`) was silently stored under the root
  (`memory://b2/abs/c3`): docs/storage.md places relative ids under the root and takes full URLs as they are,
  and an absolute path, which names another place, is now refused.
* `FsspecStorageConfig(url="s3://...", protocol="gs")` was refused only by `create_storage()` (in the writer
  process, for an async save), where the guide promises a config's faults when it is built.
* Public names given one wrong-typed or malformed argument escaped as the internals' own errors:
  `CheckpointPath.deserialize("xx")` a JSONDecodeError (where "[]" was a ConfigError), `Version(None)` an
  AttributeError about `partition`, `DTensorShardingMetadata.from_dtensor(<plain tensor>)` one about
  `device_mesh`, `compute_local_shard_info(md, "0")` "Rank 0 is not in the device mesh" (a str rank that looked
  like one); the `from_dict` of the formats and of the sharding records given no dict an AttributeError or a
  TypeError about subscripts, `DistributedMetadata.from_json` of text that is no JSON a JSONDecodeError,
  `load_distributed_metadata(dir, <a StorageConfig>)` and `DefaultStager(<no config>)` an AttributeError, and
  `FsspecStorageConfig.from_url(None)` os.fspath's TypeError.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_barrier_rounds_round26 import _together
from torch_checkpointing import CheckpointManager, ConfigError, FsspecStorageConfig, latest_checkpoint
from torch_checkpointing.barriers import TCPStoreBarrierConfig
from torch_checkpointing.checkpoint_layout import JsonSerialization, SafetensorsSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import DistributedMetadata, GlobalObjectMetadata
from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata, ShardSpec, StridedShardSpec
from torch_checkpointing.dtensor_resharder import compute_local_shard_info
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.types import CheckpointPath, RankInfo
from torch_checkpointing.version import Version


def _barrier_config() -> TCPStoreBarrierConfig:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TCPStoreBarrierConfig(30, False, port, "127.0.0.1", key_prefix="r27b")


class _StuckRemovals:
    """Rank 0's own store, whose key removals stall (`stall`) or fail (`fail`); every other call goes through."""

    def __init__(self, store: Any, how: str) -> None:
        self._store = store
        self._how = how
        self.released = threading.Event()

    def delete_key(self, key: str) -> bool:
        if self._how == "fail":
            raise RuntimeError("delete_key: the store refused it")
        self.released.wait(60)
        return bool(self._store.delete_key(key))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.parametrize("how", ["stall", "fail"])
def test_a_stalled_or_failed_key_removal_on_rank_0_does_not_fail_its_barrier(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _barrier_config()
    host, other = config.create_barrier(RankInfo(0, 2, 0, 2)), config.create_barrier(RankInfo(1, 2, 1, 2))
    assert _together(host, other, timeout_s=2) == ["passed", "passed"]
    stuck = _StuckRemovals(host._host_store, how)
    host._host_store = stuck
    host._channel = None  # its next channel talks to the wrapped store
    try:
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            # Round 2 removes round 1's keys: the removal must not decide the round for rank 0 alone.
            assert _together(host, other, timeout_s=2) == ["passed", "passed"]
    finally:
        stuck.released.set()
    assert "removing the keys of barriers 1-1" in caplog.text, "the failed removal is said, not silent"
    assert _together(host, other, timeout_s=5) == ["passed", "passed"]  # and the ranks stay in step


def test_an_absolute_id_under_an_fsspec_url_root_is_refused_naming_it_and_the_fix() -> None:
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://abs-{uuid.uuid4().hex}"
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=root))
    with CheckpointManager(config) as manager:
        for given in ("/abs/c3", "//abs/c3"):
            with pytest.raises(ConfigError, match=r"'/+abs/c3' is an absolute path") as refused:
                manager.save(given, {"w": torch.ones(2)})
            assert f"Give 'abs/c3' to use {root}/abs/c3, or the full URL" in str(refused.value), refused.value
            with pytest.raises(ConfigError, match=r"absolute path"):
                manager.load(given)
        assert not fsspec.filesystem("memory").exists(f"{root.removeprefix('memory://')}/abs/c3")
        manager.save("abs/c3", {"w": torch.ones(2)})  # the relative id is placed under the root, as documented
        assert torch.equal(manager.load("abs/c3")["w"], torch.ones(2))
    with pytest.raises(ConfigError, match=r"absolute path"):
        latest_checkpoint("/abs", FsspecStorageConfig(url=root).create_storage())


@pytest.mark.parametrize(("url", "protocol"), [("s3://b/run", "gs"), ("memory://b/run", "file"), ("gs://b", "s3a")])
def test_an_fsspec_url_of_another_store_than_its_protocol_is_refused_when_the_config_is_built(
    url: str, protocol: str
) -> None:
    pytest.importorskip("fsspec")
    with pytest.raises(ConfigError, match=rf"url {url!r} is a {url.split(':')[0]}:// path, but .* {protocol}://"):
        FsspecStorageConfig(url=url, protocol=protocol)


@pytest.mark.parametrize(("url", "protocol"), [("s3://b/run", "s3a"), ("gs://b", "gcs"), ("file:///srv/c", "local")])
def test_an_fsspec_url_of_an_alias_of_its_protocol_is_still_accepted(url: str, protocol: str) -> None:
    pytest.importorskip("fsspec")
    assert FsspecStorageConfig(url=url, protocol=protocol).protocol == protocol


@pytest.mark.parametrize("text", ["xx", "", '["a"', "{"])
def test_checkpoint_path_deserialize_of_text_that_is_no_json_is_a_config_error_naming_it(text: str) -> None:
    with pytest.raises(ConfigError, match=r"Cannot deserialize CheckpointPath from .*what serialize\(\) writes"):
        CheckpointPath.deserialize(text)


@pytest.mark.parametrize("given", [None, 7, b'["a"]', {"a": 1}, Path("x"), ["a"]])
def test_checkpoint_path_deserialize_of_no_str_is_a_config_type_error_naming_it(given: object) -> None:
    with pytest.raises(
        ConfigTypeError, match=rf"CheckpointPath.deserialize takes the str .*got {type(given).__name__}"
    ):
        CheckpointPath.deserialize(given)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", [torch.zeros(2), None, "w", {"w": torch.zeros(2)}])
def test_sharding_metadata_from_no_dtensor_is_a_config_type_error_naming_the_fix(given: object) -> None:
    with pytest.raises(ConfigTypeError, match=r"from_dtensor needs a DTensor, got .*replicated") as refused:
        DTensorShardingMetadata.from_dtensor(given)  # type: ignore[arg-type]
    assert type(given).__name__ in str(refused.value), refused.value


@pytest.mark.parametrize("given", [None, [1, 2], "w"])
def test_replicated_sharding_metadata_of_no_tensor_is_a_config_type_error(given: object) -> None:
    with pytest.raises(ConfigTypeError, match=rf"replicated needs a torch.Tensor, got {type(given).__name__}"):
        DTensorShardingMetadata.replicated(given, 2)  # type: ignore[arg-type]
    with pytest.raises(ConfigTypeError, match=r"replicated.world_size must be an int, got str '2'"):
        DTensorShardingMetadata.replicated(torch.zeros(2), "2")  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", ["0", None, 1.0, True])
def test_compute_local_shard_info_of_a_rank_that_is_no_int_is_a_config_type_error(rank: object) -> None:
    metadata = DTensorShardingMetadata.replicated(torch.zeros(4), 2)
    with pytest.raises(ConfigTypeError, match=rf"rank must be an int, got {type(rank).__name__} {rank!r}"):
        compute_local_shard_info(metadata, rank)  # type: ignore[arg-type]
    assert compute_local_shard_info(metadata, 1) == ((4,), (0,))


@pytest.mark.parametrize("given", [None, {}, "x", torch.zeros(2)])
def test_compute_local_shard_info_of_no_sharding_metadata_is_a_config_type_error(given: object) -> None:
    with pytest.raises(ConfigTypeError, match=r"needs a DTensorShardingMetadata, got"):
        compute_local_shard_info(given, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", [None, 1, b"1.0", Path("1.0")])
def test_a_version_of_no_str_is_a_config_type_error(given: object) -> None:
    with pytest.raises(ConfigTypeError, match=rf"Version takes a version str .*got {type(given).__name__}"):
        Version(given)  # type: ignore[arg-type]


_NO_DICTS = [None, 7, b"x", "x", Path("x"), [1]]


@pytest.mark.parametrize("given", _NO_DICTS)
@pytest.mark.parametrize("fmt", [JsonSerialization, SafetensorsSerialization])
def test_a_format_from_no_dict_is_a_config_type_error_naming_what_to_dict_writes(fmt: Any, given: object) -> None:
    with pytest.raises(ConfigTypeError, match=rf"{fmt.__name__}.from_dict takes the dict .*got {type(given).__name__}"):
        fmt.from_dict(given)
    assert fmt.from_dict(fmt().to_dict()) == fmt()


@pytest.mark.parametrize("given", _NO_DICTS)
@pytest.mark.parametrize("record", [GlobalObjectMetadata, ShardSpec, StridedShardSpec])
def test_a_sharding_record_from_no_dict_is_a_value_error_naming_the_field(record: Any, given: object) -> None:
    with pytest.raises(ValueError, match=rf"field 'data' must be a JSON object, got {type(given).__name__}"):
        record.from_dict(given)


@pytest.mark.parametrize("text", ["x", b"{", ""])
def test_distributed_metadata_from_text_that_is_no_json_is_a_value_error_naming_it(text: str | bytes) -> None:
    with pytest.raises(ValueError, match=r"DistributedMetadata.from_json: the text is no JSON") as refused:
        DistributedMetadata.from_json(text)
    assert isinstance(refused.value, ConfigError), "ours, not json's own JSONDecodeError"
    with pytest.raises(ConfigTypeError, match=r"DistributedMetadata.from_json takes the str or bytes .*got NoneType"):
        DistributedMetadata.from_json(None)  # type: ignore[arg-type]


def test_load_distributed_metadata_given_a_storage_config_names_create_storage(tmp_path: Path) -> None:
    from torch_checkpointing import LocalFileSystemStorageConfig
    from torch_checkpointing.distributed_metadata import load_distributed_metadata

    with pytest.raises(ConfigTypeError, match=r"needs a Storage, got LocalFileSystemStorageConfig \(call its create"):
        load_distributed_metadata(tmp_path, LocalFileSystemStorageConfig())  # type: ignore[arg-type]
    with pytest.raises(ConfigTypeError, match=r"needs a Storage, got str;"):
        load_distributed_metadata(tmp_path, str(tmp_path))  # type: ignore[arg-type]
    assert load_distributed_metadata(tmp_path, LocalFileSystemStorageConfig().create_storage()) is None


@pytest.mark.parametrize("given", ["pinned", {"use_pinned_memory": False}, 1])
def test_a_default_stager_given_no_stager_config_is_a_config_type_error(given: object) -> None:
    from torch_checkpointing.staging import DefaultStager

    with pytest.raises(
        ConfigTypeError, match=r"DefaultStager.config must be a CheckpointStagerConfig, got .*Pass one, or None"
    ):
        DefaultStager(given)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", [None, 7, b"s3://b", Path("s3://b")])
def test_fsspec_config_from_no_url_str_is_a_config_type_error(given: object) -> None:
    with pytest.raises(ConfigTypeError, match=r"from_url takes a URL str"):
        FsspecStorageConfig.from_url(given)  # type: ignore[arg-type]
