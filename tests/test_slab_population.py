"""A new memfd staging slab is allocated and mapped before the first save's copy, on more than one core, and a
range the kernel cannot back is an error, not a SIGBUS in the middle of a copy."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest
import torch

from torch_checkpointing.memory_advice import populate_write
from torch_checkpointing.staging import SharedSlab

_MIB = 1024 * 1024


def _mapped_rss(address: int) -> int:
    """Resident bytes of this process's mapping that holds `address` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def _need_linux_populate() -> None:
    if not Path("/proc/self/smaps").exists():
        pytest.skip("needs /proc/self/smaps")


def test_a_new_memfd_slab_is_mapped_before_anything_is_copied_into_it() -> None:
    """Before: posix_fallocate gave the memfd its pages but mapped none, and the first save's copy took a
    page fault for every 4 KiB, on the copying core."""
    _need_linux_populate()
    slab = SharedSlab.allocate(192 * _MIB, None)
    try:
        assert slab.where == "anonymous shared memory"
        assert _mapped_rss(slab.tensor.data_ptr()) >= 192 * _MIB
    finally:
        slab.close()


def test_populating_uses_several_threads_for_a_large_range(monkeypatch: pytest.MonkeyPatch) -> None:
    _need_linux_populate()
    import threading

    names: set[str] = set()
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        names.add(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    fd = os.memfd_create("populate-test")
    try:
        os.ftruncate(fd, 256 * _MIB)
        with mmap.mmap(fd, 256 * _MIB) as mapped:
            address = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
            assert populate_write(address, address + 256 * _MIB, 2) is True
            assert _mapped_rss(address) >= 256 * _MIB
    finally:
        os.close(fd)
    assert "ckpt-populate" in names


def test_a_range_past_the_end_of_its_file_is_an_error_not_a_sigbus(tmp_path: Path) -> None:
    """A shared mapping beyond its file's end has no page to give: a copy there would die of SIGBUS; populating
    it raises the OSError that the stager turns into its 'no room' message."""
    _need_linux_populate()
    pages = 16 * mmap.PAGESIZE
    fd = os.open(tmp_path / "shrunk", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, pages)
        mapped = mmap.mmap(fd, pages)
        os.ftruncate(fd, mmap.PAGESIZE)  # the mapping keeps its 16 pages; the file now backs one
        address = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
        with pytest.raises(OSError) as info:
            populate_write(address, address + pages, 1)
        assert info.value.errno in (errno.EFAULT, errno.ENOMEM)
    finally:
        os.close(fd)
