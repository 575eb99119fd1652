"""Staging slabs are freed off the caller's thread (close() and layout changes), without breaking views that
are still held: for shared memory, MADV_DONTNEED only unmaps, the data stays in the memfd."""

from __future__ import annotations

import threading
import time

import torch

from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager


def _stager() -> DefaultStager:
    return DefaultStager(CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False))


def _wait_for_free_threads(timeout: float = 10.0) -> None:
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
