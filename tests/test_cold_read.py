"""The check of a whole local file that is not in the page cache: pread streams instead of a mapping.

`crc32_by_reads` must give zlib's CRC32 for every split of a file into streams and reads, must end (with the
caller's error) when the file is shorter than the size it was asked for, and a verified load of a checkpoint
whose files were dropped from the page cache must still refuse a flipped bit and restore an intact one.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, read_context
from torch_checkpointing.cold_read import READ_BYTES, crc32_by_reads, is_cached
from torch_checkpointing.errors import CorruptCheckpointError


class _Short(Exception):
    pass


def _file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("size", [1, 4095, READ_BYTES - 1, READ_BYTES, 2 * READ_BYTES + 7, 5 * READ_BYTES + 123])
@pytest.mark.parametrize("streams", [1, 2, 3, 8])
def test_crc_matches_zlib(tmp_path: Path, size: int, streams: int) -> None:
    data = _file(tmp_path / "f", size)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with ThreadPoolExecutor(2) as pool:
            got = crc32_by_reads(fd, size, pool, streams, lambda off: _Short(off))
    finally:
        os.close(fd)
    assert got == zlib.crc32(data)


def test_a_file_shorter_than_asked_raises_the_callers_error(tmp_path: Path) -> None:
    size = 3 * READ_BYTES
    _file(tmp_path / "f", size)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        os.truncate(tmp_path / "f", size - READ_BYTES - 5)  # shrank after the load sized it
        with ThreadPoolExecutor(2) as pool, pytest.raises(_Short) as info:
            crc32_by_reads(fd, size, pool, 3, lambda off: _Short(off))
    finally:
        os.close(fd)
    assert info.value.args[0] == size - READ_BYTES - 5


def _drop(path: Path) -> bool:
    """Drop a file from the page cache; whether the system demonstrably did (a RWF_NOWAIT read is refused).

    The proof reads the file's last page: a refused RWF_NOWAIT read still starts readahead from where it asked,
    and a proof at offset 0 raced `is_cached`'s own first probe there (the readahead could land before it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        last_page = max(0, os.fstat(fd).st_size - 1) & ~4095
        try:
            os.preadv(fd, [bytearray(4096)], last_page, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


def test_is_cached_tells_a_dropped_file_from_a_read_one(tmp_path: Path) -> None:
    path = tmp_path / "f"
    _file(path, 4 * READ_BYTES)
    if not _drop(path):
        pytest.skip("this file system keeps the file cached (tmpfs) or has no RWF_NOWAIT")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not is_cached(fd, 4 * READ_BYTES)
        os.pread(fd, 4 * READ_BYTES, 0)
        assert is_cached(fd, 4 * READ_BYTES)
    finally:
        os.close(fd)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the files the load checked by reads (the cold path), as it calls `crc32_by_reads`."""
    sizes: list[int] = []

    def counted(fd: int, size: int, *args: object) -> int:
        sizes.append(size)
        return crc32_by_reads(fd, size, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(read_context, "crc32_by_reads", counted)
    return sizes


def _saved(tmp_path: Path) -> tuple[CheckpointManager, Path, dict[str, torch.Tensor]]:
    mgr = CheckpointManager(CheckpointManager.Config.with_sync_save())
    state = {"w": torch.randn(6 * READ_BYTES // 4), "b": torch.arange(10.0)}
    mgr.save(str(tmp_path / "ck"), {"model": state})
    return mgr, tmp_path / "ck", state


def _dropped_all(root: Path) -> bool:
    dropped = [_drop(p) for p in sorted(root.rglob("*")) if p.is_file()]  # every file, not up to the first
    return all(dropped)


def test_a_cold_verified_load_restores_the_saved_values(tmp_path: Path, reads: list[int]) -> None:
    mgr, root, state = _saved(tmp_path)
    try:
        if not _dropped_all(root):
            pytest.skip("this file system keeps the files cached (tmpfs) or has no RWF_NOWAIT")
        into = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
        mgr.load(str(root), into=into)
        assert all(torch.equal(into["model"][k], v) for k, v in state.items())
        assert reads == [max(p.stat().st_size for p in root.rglob("*.pt"))]  # the large file, by reads
        reads.clear()
        mgr.load(str(root), into=into)  # now cached: through the mapping
        assert reads == []
    finally:
        mgr.close()


def test_a_cold_verified_load_refuses_a_flipped_bit_and_changes_nothing(tmp_path: Path, reads: list[int]) -> None:
    mgr, root, state = _saved(tmp_path)
    try:
        data_file = max((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        with open(data_file, "r+b") as f:
            f.seek(data_file.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        if not _dropped_all(root):
            pytest.skip("this file system keeps the files cached (tmpfs) or has no RWF_NOWAIT")
        into = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
        with pytest.raises(CorruptCheckpointError, match="CRC32"):
            mgr.load(str(root), into=into)
        assert all(not t.any() for t in into["model"].values())
        assert reads
    finally:
        mgr.close()


def test_a_cold_file_is_decoded_after_its_check_has_read_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's small reads (the pickle, the zip directory, a header per record) each waited for the disk
    while the check streamed the same file: decoding a cold file now starts once its check is done, so it
    reads cached pages. (A cached file's decode still overlaps its check.)"""
    from torch_checkpointing import codecs

    events: list[str] = []

    def checked_by_reads(fd: int, size: int, *args: object) -> int:
        try:
            return crc32_by_reads(fd, size, *args)  # type: ignore[arg-type]
        finally:
            events.append("checked")

    real_load = codecs.torch.load

    def load(*args: object, **kwargs: object) -> object:
        events.append("decode")
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(read_context, "crc32_by_reads", checked_by_reads)
    monkeypatch.setattr(codecs.torch, "load", load)
    mgr, root, state = _saved(tmp_path)
    try:
        if not _dropped_all(root):
            pytest.skip("this file system keeps the files cached (tmpfs) or has no RWF_NOWAIT")
        into = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
        events.clear()
        mgr.load(str(root), into=into)
        assert all(torch.equal(into["model"][k], v) for k, v in state.items())
        assert events == ["checked", "decode"]
    finally:
        mgr.close()
