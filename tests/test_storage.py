"""Storage: the base classes, the local filesystem backend, direct I/O with its buffered fallback, and proof
that every save and load goes through the configured backend."""

from __future__ import annotations

import errno
import fcntl
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.memory_storage import MemoryStorage, MemoryStorageConfig
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
    TorchSerialization,
)
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage import direct_io
from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
from torch_checkpointing.storage.filesystem import (
    LocalFileSystemStorage,
    LocalFileSystemStorageConfig,
    WriteStream,
)

CHUNK = direct_io.CHUNK


# -------------------------------------------------------------------------------------- base classes


def test_base_classes_are_abstract() -> None:
    with pytest.raises(TypeError):
        Storage()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        StorageConfig()  # type: ignore[abstract]


def test_read_args_defaults() -> None:
    assert ReadArgs() == ReadArgs(pre_read_full_file=True, direct_io=False, timeout_us=900_000_000)


def test_base_read_and_glob_use_the_abstract_methods() -> None:
    storage = MemoryStorageConfig().create_storage()
    storage.mkdir(Path("/d/sub"))
    storage.write(Path("/d/a.pt"), b"A")
    storage.write(Path("/d/b.json"), memoryview(b"B"))
    assert storage.read(Path("/d/a.pt")) == b"A"
    assert sorted(storage.glob("/d/*.pt")) == ["/d/a.pt"]
    assert sorted(storage.glob("/d/*")) == ["/d/a.pt", "/d/b.json", "/d/sub"]
    assert storage.glob("/nope/*") == []


def test_base_replace_directory_replaces_only_once_the_new_one_is_in_place() -> None:
    storage = MemoryStorageConfig().create_storage()
    for d, content in (("/ck", b"old"), ("/tmp-new", b"new")):
        storage.mkdir(Path(d))
        storage.write(Path(d) / "f", content)
    storage.write(Path("/ck/stale"), b"x")
    storage.replace_directory(Path("/tmp-new"), Path("/ck"))
    assert storage.read(Path("/ck/f")) == b"new"
    assert not storage.exists(Path("/ck/stale")) and not storage.exists(Path("/tmp-new"))
    assert sorted(storage.ls(Path("/"))) == ["ck"]


# -------------------------------------------------------------------------------------- local filesystem


def test_local_config_defaults_and_factory() -> None:
    config = LocalFileSystemStorageConfig()
    assert config.use_direct_io is True
    storage = config.create_storage()
    assert isinstance(storage, LocalFileSystemStorage) and storage.config is config
    with pytest.raises(ValueError):
        LocalFileSystemStorage(None)


@pytest.mark.parametrize("use_direct_io", [True, False])
def test_local_storage_operations(tmp_path: Path, use_direct_io: bool) -> None:
    s = LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=use_direct_io))
    with pytest.raises(RuntimeError, match="Parent directory does not exist"):
        s.write(tmp_path / "missing" / "f", b"x")
    s.mkdir(tmp_path / "a" / "b")
    assert s.isdir(tmp_path / "a" / "b")
    s.write(tmp_path / "a" / "b" / "f", b"hello")
    with s.stream_write(tmp_path / "a" / "g") as stream:
        stream.write(b"wor")
        stream.write(bytearray(b"ld"))
    assert s.read(tmp_path / "a" / "g") == b"world"
    assert s.stream_read(tmp_path / "a" / "b" / "f").read() == b"hello"
    assert s.stream_read(tmp_path / "a" / "b" / "f", ReadArgs(pre_read_full_file=False)).read() == b"hello"
    assert s.read_range(tmp_path / "a" / "g", 1, 3) == b"orl"
    assert s.getsize(tmp_path / "a" / "b" / "f") == 5
    assert sorted(s.ls(tmp_path / "a")) == ["b", "g"]
    assert s.exists(tmp_path / "a" / "g") and not s.exists(tmp_path / "zz")
    with pytest.raises(FileNotFoundError):
        s.stream_read(tmp_path / "zz")
    with pytest.raises(FileNotFoundError):
        s.getsize(tmp_path / "zz")
    s.rename(tmp_path / "a", tmp_path / "c", is_directory=True)
    assert s.read(tmp_path / "c" / "b" / "f") == b"hello"
    s.delete(tmp_path / "c" / "g")
    assert not s.exists(tmp_path / "c" / "g")
    s.sync_directory(tmp_path / "c")
    s.rmdir(tmp_path / "c")
    assert not s.exists(tmp_path / "c")
    assert s.remap_path(tmp_path / "x") == str(tmp_path / "x")
    assert s.local_path(tmp_path / "x") == str(tmp_path / "x")


def test_local_replace_directory_is_an_exchange(tmp_path: Path) -> None:
    s = LocalFileSystemStorage(LocalFileSystemStorageConfig())
    for d, content in (("ck", b"old"), ("new", b"new")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "f").write_bytes(content)
    (tmp_path / "ck" / "stale").write_bytes(b"x")
    s.replace_directory(tmp_path / "new", tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert sorted(os.listdir(tmp_path / "ck")) == ["f"] and (tmp_path / "ck" / "f").read_bytes() == b"new"
    s.replace_directory(tmp_path / "ck", tmp_path / "fresh")
    assert sorted(os.listdir(tmp_path)) == ["fresh"]


def test_direct_io_is_used_on_this_filesystem(tmp_path: Path) -> None:
    stream = LocalFileSystemStorage(LocalFileSystemStorageConfig()).stream_write(tmp_path / "f")
    assert isinstance(stream, WriteStream)
    try:
        assert stream.uses_direct_io, "O_DIRECT was not used on a filesystem that supports it"
        stream.write(b"x" * 10_000)
    finally:
        stream.close()
    assert (tmp_path / "f").read_bytes() == b"x" * 10_000


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    chunks=st.lists(
        st.one_of(st.binary(max_size=9000), st.integers(0, 3).map(lambda k: b"\xab" * (4096 * k))), max_size=6
    ),
    use_direct_io=st.booleans(),
)
def test_durable_writer_writes_exactly_the_bytes(tmp_path: Path, chunks: list[bytes], use_direct_io: bool) -> None:
    path = tmp_path / f"f-{use_direct_io}"
    with LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=use_direct_io)).stream_write(path) as s:
        for c in chunks:
            assert s.write(c) == len(c)
    assert path.read_bytes() == b"".join(chunks)


# ------------------------------------------------------------------------------- direct I/O refusals


class RefusingOs:
    """Stands in for `os` inside direct_io.py: refuses O_DIRECT at the chosen step with an errno."""

    def __init__(self, refuse: str, err: int = errno.EINVAL) -> None:
        self.refuse = refuse
        self.err = err
        self.direct_fds: set[int] = set()
        self.refusals: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _refuse(self, step: str) -> None:
        self.refusals.append(step)
        raise OSError(self.err, f"simulated refusal of O_DIRECT at {step}")

    def _is_direct(self, fd: int) -> bool:
        return fd in self.direct_fds or bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    def open(self, path: Any, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT and self.refuse == "open":
            self._refuse("open")
        fd = os.open(path, flags, mode)
        if flags & os.O_DIRECT:
            self.direct_fds.add(fd)
        return fd

    def write(self, fd: int, data: Any) -> int:
        if self.refuse == "write" and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT):
            self._refuse("write")
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        if self.refuse == "fsync" and fd in self.direct_fds:
            self._refuse("fsync")
        os.fsync(fd)

    def close(self, fd: int) -> None:
        direct = fd in self.direct_fds
        self.direct_fds.discard(fd)
        os.close(fd)
        if self.refuse == "close" and direct:
            self._refuse("close")


SIZES = [100, 4096 * 3, 4096 * 2 + 7, CHUNK + 4096 + 9]


@pytest.mark.parametrize("step", ["open", "write", "fsync", "close"])
@pytest.mark.parametrize("size", SIZES, ids=["tiny", "aligned", "unaligned", "over-chunk"])
def test_refused_direct_io_falls_back_to_buffered(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, step: str, size: int
) -> None:
    fake = RefusingOs(step)
    monkeypatch.setattr(direct_io, "os", fake)
    data = os.urandom(size)
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig(use_direct_io=True))
    with storage.stream_write(tmp_path / "f") as stream:
        half = size // 3
        stream.write(data[:half])
        stream.write(data[half:])
    monkeypatch.undo()
    assert (tmp_path / "f").read_bytes() == data
    if step != "write" or size >= 4096:
        assert fake.refusals, f"the simulated refusal at {step} never happened: the test proves nothing"


@pytest.mark.parametrize("step", ["open", "write", "fsync", "close"])
def test_save_succeeds_when_direct_io_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, step: str) -> None:
    fake = RefusingOs(step)
    monkeypatch.setattr(direct_io, "os", fake)
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    try:
        weights = torch.randn(5000)
        manager.save(str(tmp_path / "c"), {"model": {"w": weights}, "blob": os.urandom(9000)})
        monkeypatch.undo()
        out = manager.load(str(tmp_path / "c"), into={"model": {"w": torch.zeros(5000)}, "blob": None})
    finally:
        manager.close()
    assert torch.equal(out["model"]["w"], weights)
    assert fake.refusals


def test_other_write_errors_are_not_swallowed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(direct_io, "os", RefusingOs("write", errno.ENOSPC))
    stream = LocalFileSystemStorage(LocalFileSystemStorageConfig()).stream_write(tmp_path / "f")
    stream.write(b"x" * 8192)
    with pytest.raises(OSError) as info:
        stream.close()
    assert info.value.errno == errno.ENOSPC


# ------------------------------------------------------------------------------- everything via storage


def test_sync_save_and_load_go_only_through_the_configured_storage(tmp_path: Path) -> None:
    config = MemoryStorageConfig()
    items = {
        "model": ItemSpec(layout=LayoutInfo("rank_{rank}/model.safetensors", SafetensorsSerialization())),
        "meta": ItemSpec(layout=LayoutInfo("meta.json", JsonSerialization())),
        "blob": ItemSpec(layout=LayoutInfo("blob.bin", RawSerialization())),
        "opt": ItemSpec(layout=LayoutInfo("opt_{rank}.pt", TorchSerialization())),
    }
    manager = CheckpointManager(
        CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), storage_config=config)
    )
    target = tmp_path / "ckpts" / "step1"
    try:
        manager.save(
            str(target),
            {"model": {"w": torch.ones(3)}, "meta": {"step": 1}, "blob": b"\x00\x01", "opt": [1, 2], "extra": 5},
        )
        manager.save(
            str(target),
            {"model": {"w": torch.full((3,), 2.0)}, "meta": {"step": 2}, "blob": b"\x02", "opt": [3], "extra": 6},
        )
        assert list(tmp_path.iterdir()) == [], "the save wrote to the local disk instead of the configured storage"
        w = torch.zeros(3)
        out = manager.load(
            str(target), into={"model": {"w": w}, "meta": None, "blob": None, "opt": None, "extra": None}
        )
    finally:
        manager.close()
    assert list(tmp_path.iterdir()) == []
    assert torch.equal(w, torch.full((3,), 2.0))
    assert out["meta"] == {"step": 2} and out["blob"] == b"\x02" and out["opt"] == [3] and out["extra"] == 6
    stored = {k[len(str(target)) + 1 :] for k in config.store.files if k.startswith(str(target) + "/")}
    assert stored == {"rank_0/model.safetensors", "meta.json", "blob.bin", "opt_0.pt", "extra_0.pt", "manifest.json"}
    reads = {p for op, p in config.store.calls if op == "read"}
    assert {str(target / "meta.json"), str(target / "blob.bin"), str(target / "opt_0.pt")} <= reads


def test_memory_backend_has_no_local_path() -> None:
    storage = MemoryStorageConfig().create_storage()
    assert isinstance(storage, MemoryStorage)
    assert storage.local_path(Path("/x")) is None
    assert storage.remap_path(Path("/x")) == "memory:///x"
    stream = storage.stream_write(Path("/f")) if storage.isdir(Path("/")) else io.BytesIO()
    stream.write(b"ok")
    stream.close()
    assert storage.read(Path("/f")) == b"ok"
