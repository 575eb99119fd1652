"""Small public pieces: version, paths, barriers, builders."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch

from torch_checkpointing import (
    ItemSpec,
    Version,
    __version__,
    get_version,
    make_async_checkpoint_saver,
    make_sync_checkpoint_saver,
)
from torch_checkpointing.barriers import TCPStoreBarrierConfig
from torch_checkpointing.checkpoint_saver import SavePlan
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.schema import resolve
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.types import CheckpointPath, RankInfo


def test_version_splits_on_the_first_plus() -> None:
    v = Version("1.2.3+abc+def")
    assert (v.get_version(), v.get_sha(), v.get_full_version()) == ("1.2.3", "abc+def", "1.2.3+abc+def")
    assert str(v) == "1.2.3+abc+def" and repr(v) == "Version('1.2.3+abc+def')"
    assert Version("0.1").get_sha() is None


def test_installed_version_is_reported() -> None:
    found = get_version()
    assert found is not None and found.get_full_version() == __version__ != "Unknown"


def test_checkpoint_path_string_and_json_forms() -> None:
    p = CheckpointPath("model", ("layers", 0, "w"))
    assert str(p) == "model::layers.0.w" and str(CheckpointPath("step")) == "step"
    assert CheckpointPath.deserialize(p.serialize()) == p
    with pytest.raises(ValueError, match="empty"):
        CheckpointPath.deserialize("[]")


@pytest.mark.parametrize("text", ['"ab"', "{}", '{"a": 1}', "[1]", '["a", {}]', '["a", [1, {"b": 2}]]', "5"])
def test_checkpoint_path_deserialize_refuses_what_serialize_never_writes(text: str) -> None:
    """API_SURFACE §6: `serialize()` is a compact JSON list `["item", "a", 0]` (a str item key, then str keys and
    int indices) and `deserialize` its inverse. Other JSON was taken apart as if it were one: '"ab"' read as item
    'a' at path ('b',), '[1]' as an int item key, a dict as "empty list"; each is a ConfigError (a ValueError)
    naming the text and the form expected."""
    with pytest.raises(ConfigError, match=r"CheckpointPath.*\["):
        CheckpointPath.deserialize(text)
    assert CheckpointPath.deserialize('["m", "state", 0, "exp_avg"]') == CheckpointPath("m", ("state", 0, "exp_avg"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcpstore_barrier_releases_when_every_rank_arrived() -> None:
    config = TCPStoreBarrierConfig(30, False, _free_port(), "127.0.0.1", key_prefix="t")
    host = config.create_barrier(RankInfo(0, 2, 0, 2))
    other = config.create_barrier(RankInfo(1, 2, 1, 2))
    passed: list[str] = []
    thread = threading.Thread(target=lambda: (other.execute_barrier(30), passed.append("rank 1")))
    thread.start()
    host.execute_barrier(30)
    thread.join(30)
    assert passed == ["rank 1"]


def test_tcpstore_barrier_times_out_naming_the_missing_rank() -> None:
    config = TCPStoreBarrierConfig(30, False, _free_port(), "127.0.0.1")
    host = config.create_barrier(RankInfo(0, 2, 0, 2))
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]") as raised:
        host.execute_barrier(1)
    # Before: "Checkpoint commit: ... No checkpoint was committed." from a barrier that commits nothing.
    assert "commit" not in str(raised.value) and "barrier 1" in str(raised.value), raised.value


def test_a_barrier_whose_host_is_unreachable_times_out_in_the_barriers_words() -> None:
    """Round 25: role rank 1 with nothing listening at the barrier's port (rank 0 gone, or not yet made) raised
    CommitError "Checkpoint commit: lost contact with rank 0 ... closed its CheckpointManager. No checkpoint was
    committed by this save." from a barrier, which commits nothing (its own timeouts are TimeoutErrors)."""
    port = _free_port()
    barrier = TCPStoreBarrierConfig(1, False, port, "127.0.0.1").create_barrier(RankInfo(1, 2, 1, 2))
    with pytest.raises(TimeoutError, match=rf"rank 0, .*127\.0\.0\.1:{port}, is unreachable") as raised:
        barrier.execute_barrier(1)
    assert "commit" not in str(raised.value).lower() and "CheckpointManager" not in str(raised.value), raised.value


@pytest.mark.parametrize("libuv", [False, True], ids=["classic", "libuv"])
def test_a_barrier_host_on_a_port_in_use_is_refused_naming_the_field(libuv: bool) -> None:
    """Round 25: role rank 0's barrier on a port another socket listens on raised torch's DistNetworkError, with
    pages of C++ frames and no word of which setting to change. The libuv store (torch's default) words it
    "EADDRINUSE ... address already in use": it is said in use too."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = TCPStoreBarrierConfig(5, libuv, port, "127.0.0.1")
        with pytest.raises(ConfigError, match=rf"tcpstore_port {port}: .*\(the port is in use\)") as raised:
            config.create_barrier(RankInfo(0, 2, 0, 2))
    assert "frame #" not in str(raised.value), raised.value


def test_builders_make_working_savers(tmp_path: Path) -> None:
    storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    saver = make_sync_checkpoint_saver(storage_config=storage_config)
    items = resolve({"w": torch.ones(2)}, {}, ItemSpec(), 0)
    plan = SavePlan(
        checkpoint_dir=str(tmp_path / "c"), tmp_dir=str(tmp_path / ".c.tmp"), rank=0, world_size=1, items=tuple(items)
    )
    assert saver.save(plan) is None and (tmp_path / "c" / "manifest.json").is_file()
    saver.close()
    async_saver = make_async_checkpoint_saver(storage_config=storage_config)
    try:
        plan = SavePlan(
            checkpoint_dir=str(tmp_path / "d"),
            tmp_dir=str(tmp_path / ".d.tmp"),
            rank=0,
            world_size=1,
            items=tuple(items),
        )
        async_saver.save(plan).result(timeout=120)
        assert (tmp_path / "d" / "w_0.pt").is_file()
    finally:
        async_saver.close()
