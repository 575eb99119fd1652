"""Staging slabs are freed off the caller's thread (close() and layout changes), without breaking views that
are still held: for shared memory, MADV_DONTNEED only unmaps, the data stays in the memfd.

Off the thread is checked by holding the release back: the engine's MADV_DONTNEED call (`staging.madvise`, the
first step of freeing a slab) is made slow, and the caller's close() or layout change must return while the slab
is still mapped and its descriptor still open, seen in /proc/self/maps and /proc/self/fd; once the release goes
on, both go away. A release done inline would make the caller wait out the hold and find the slab gone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.probes import memory_maps
from torch_checkpointing import staging
from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager

# How long the slowed release holds a slab unless let go: what a caller that frees inline would wait before it
# returns. Long, so that a busy machine cannot see the hold end before the test has looked at it.
HOLD_S = 30.0
GONE_TIMEOUT_S = 30.0


def _stager(staging_dir: str | None = None) -> DefaultStager:
    return DefaultStager(
        CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False, staging_dir=staging_dir)
    )


class HeldRelease:
    """Stands in for `staging.madvise`: notes the thread that starts freeing a slab, then holds it until `go`."""

    def __init__(self, real: Callable[[int, int, int], None]) -> None:
        self.real = real
        self.threads: dict[int, int] = {}  # slab start address -> the thread that began to free it
        self.finished: set[int] = set()  # slab start addresses whose advice has been given
        self.go = threading.Event()

    def __call__(self, start: int, end: int, advice: int) -> None:
        self.threads[start] = threading.get_ident()
        self.go.wait(HOLD_S)
        self.real(start, end, advice)
        self.finished.add(start)


@pytest.fixture
def held_release(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldRelease]:
    release = HeldRelease(staging.madvise)
    monkeypatch.setattr(staging, "madvise", release)
    yield release
    release.go.set()


def _slab_region(address: int) -> tuple[int, str] | None:
    """(address, inode) of the staging mapping that holds `address`, or None: an inode, because once the slab
    is unmapped another mapping may land on the same addresses."""
    for region in memory_maps():
        if region.start <= address < region.end and "torch_checkpointing-staging" in region.path:
            return address, region.inode
    return None


def _slab_fds() -> set[int]:
    """This process's descriptors on a staging slab (memfd or unlinked file in a staging_dir)."""
    found = set()
    for entry in Path("/proc/self/fd").iterdir():
        try:
            if "torch_checkpointing-staging" in os.readlink(entry):
                found.add(int(entry.name))
        except OSError:  # closed since the listing (the listing's own descriptor, for one)
            continue
    return found


def _wait_until(condition: Callable[[], bool], timeout: float = GONE_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _close(stager: DefaultStager) -> None:
    stager.close()


def _change_layout(stager: DefaultStager) -> None:
    stager.stage({"a": torch.ones(50_000)})


@pytest.mark.parametrize("where", ["memfd", "staging_dir"])
@pytest.mark.parametrize("release", [_close, _change_layout], ids=["close", "layout_change"])
def test_a_released_slab_is_freed_off_the_callers_thread(
    held_release: HeldRelease, tmp_path: Path, where: str, release: Callable[[DefaultStager], None]
) -> None:
    stager = _stager(os.fspath(tmp_path) if where == "staging_dir" else None)
    fds_before = _slab_fds()
    stager.stage({"a": torch.ones(300_000)})  # the staged tree is dropped: only the stager views the slab
    slab = stager.slab
    assert slab is not None
    mapped = _slab_region(slab.data_ptr())
    del slab
    fds = _slab_fds() - fds_before
    assert mapped is not None and len(fds) == 1, (mapped, fds)
    address = mapped[0]
    try:
        started = time.monotonic()
        release(stager)
        returned_in = time.monotonic() - started
        assert _wait_until(lambda: address in held_release.threads), "the slab was never advised away (nor freed)"
        assert held_release.threads[address] != threading.get_ident(), "the slab was freed on the caller's thread"
        assert address not in held_release.finished and returned_in < HOLD_S, "the caller waited for the release"
        assert _slab_region(address) == mapped and fds <= _slab_fds(), "freed before the release went on, inline"
        held_release.go.set()
        assert _wait_until(lambda: _slab_region(address) != mapped), "the released slab stayed mapped"
        assert _wait_until(lambda: not fds & _slab_fds()), "the released slab's descriptor stayed open"
    finally:
        held_release.go.set()
        stager.close()


def _wait_for_free_threads(timeout: float = GONE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while any(t.name == "ckpt-staging-free" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_staged_views_survive_close() -> None:
    src = {"a": torch.arange(300_000, dtype=torch.float32), "b": [torch.ones(5, 7, dtype=torch.bfloat16)]}
    stager = _stager()
    staged = stager.stage(src)
    stager.close()
    _wait_for_free_threads()
    assert torch.equal(staged["a"], src["a"]) and torch.equal(staged["b"][0], src["b"][0])


def test_layout_change_keeps_the_previous_staged_tree() -> None:
    stager = _stager()
    first = stager.stage({"a": torch.full((100_000,), 3.0)})
    second = stager.stage({"a": torch.full((50_000,), 4.0)})  # new layout: the old slab is released
    _wait_for_free_threads()
    assert bool((first["a"] == 3.0).all()) and bool((second["a"] == 4.0).all())
    stager.close()


def test_private_slab_is_not_advised_away() -> None:
    stager = DefaultStager(
        CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False, use_shared_memory=False)
    )
    staged = stager.stage({"a": torch.full((100_000,), 2.0)})
    stager.close()
    _wait_for_free_threads()
    assert bool((staged["a"] == 2.0).all())
