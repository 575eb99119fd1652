"""A new staging slab is backed with memory on a thread, chunk by chunk, while the first copy fills it behind."""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import pytest
import torch

from torch_checkpointing import staging
from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager

_CHUNK = 64 << 10  # small chunks, so that modest tensors span several of them


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "_POPULATE_CHUNK", _CHUNK)


def _stager() -> DefaultStager:
    return DefaultStager(CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False))


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {
            "big": torch.randn(300_000, generator=gen),  # spans many chunks
            "bf16": torch.randn(1000, 77, generator=gen).to(torch.bfloat16),
            "transposed": torch.randn(300, 500, generator=gen).t(),  # not contiguous: copied whole
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(3.5),
            "ints": torch.arange(70_001, dtype=torch.int64),
        },
        "step": 7,
    }


def _assert_same(staged: dict[str, Any], state: dict[str, Any]) -> None:
    assert staged["step"] == state["step"]
    for key, value in state["model"].items():
        out = staged["model"][key]
        assert out.dtype == value.dtype and out.shape == value.shape, key
        assert torch.equal(out, value), key


def test_first_copy_into_a_new_slab_is_exact_and_the_second_reuses_it() -> None:
    stager, state = _stager(), _state()
    try:
        _assert_same(stager.stage(state), state)
        slab = stager.slab
        state["model"]["big"].mul_(2)
        _assert_same(stager.stage(state), state)
        assert stager.slab is slab
    finally:
        stager.close()


def test_the_slab_is_reserved_off_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    callers: list[str] = []
    real = os.posix_fallocate

    def record(fd: int, offset: int, length: int) -> None:
        callers.append(threading.current_thread().name)
        real(fd, offset, length)

    monkeypatch.setattr(staging.os, "posix_fallocate", record)
    stager = _stager()
    try:
        stager.stage(_state())
    finally:
        stager.close()
    assert len(callers) > 1, "reserved in one piece, not chunk by chunk"
    assert threading.current_thread().name not in callers


def test_a_failed_reservation_is_raised_and_the_next_stage_starts_over(monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = os.posix_fallocate, []

    def full_after_two(fd: int, offset: int, length: int) -> None:
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(staging.os, "posix_fallocate", full_after_two)
    stager, state = _stager(), _state()
    try:
        with pytest.raises(OSError, match="staging_dir") as info:
            stager.stage(state)
        assert info.value.errno == errno.ENOSPC
        assert stager.slab is None, "a slab that was never fully backed was kept"
        _assert_same(stager.stage(state), state)
    finally:
        stager.close()
