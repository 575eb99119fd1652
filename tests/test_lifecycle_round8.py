"""The manager's lifecycle under real misuse and concurrency (round 8).

What these pin, each with real threads, processes and files:
* a `lock()` taken back to back by a training thread (`with manager.lock(): optimizer.step()` in a loop) never
  starves a `save()` on another thread: a waiting save goes before new lock() holders (it waited until
  `wait_timeout_secs`, then failed with the "deadlock" RuntimeError);
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.lock import RWLock, RWLockMode
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

WAIT_S = 5


def _async_manager(wait_s: float = WAIT_S) -> CheckpointManager:
    config = CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    config.save.wait_timeout_secs = wait_s
    return CheckpointManager(config)


@pytest.fixture(scope="module")
def manager() -> Iterator[CheckpointManager]:
    """One async manager for the tests that leave it usable (a writer process costs seconds to start)."""
    shared = _async_manager()
    yield shared
    shared.close()


# ------------------------------------------------------------------------------------ lock() never starves save()


class _BackToBackReaders:
    """Threads taking the read side in a tight loop, each release followed at once by the next acquire."""

    def __init__(self, *, lock: RWLock, threads: int = 2) -> None:
        self.lock = lock
        self.stop = threading.Event()
        self.holds = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock.hold(RWLockMode.READ, timeout=WAIT_S * 4):
                self.holds += 1
                time.sleep(0.0005)  # an optimizer step: the GIL is released while the lock is held

    def __enter__(self) -> _BackToBackReaders:
        for t in self.threads:
            t.start()
        while self.holds < 10:  # the readers are overlapping before the writer comes
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(WAIT_S * 4)


def test_a_waiting_writer_goes_before_new_readers() -> None:
    lock = RWLock()
    with _BackToBackReaders(lock=lock, threads=2):
        started = time.monotonic()
        lock.acquire(RWLockMode.WRITE, timeout=WAIT_S)  # before: RuntimeError "deadlock" after WAIT_S
        waited = time.monotonic() - started
        lock.release(RWLockMode.WRITE)
    assert waited < 1.0, waited


def test_a_reader_inside_its_own_read_hold_is_not_stopped_by_a_waiting_writer() -> None:
    # Nested `with manager.lock():` on one thread while a save waits: refusing the inner hold would deadlock.
    lock = RWLock()
    lock.acquire(RWLockMode.READ, timeout=1)
    writer = threading.Thread(target=lambda: lock.hold(RWLockMode.WRITE, timeout=WAIT_S).__enter__())
    writer.start()
    time.sleep(0.2)  # the writer is waiting now
    lock.acquire(RWLockMode.READ, timeout=1)  # must not wait for the writer that waits for us
    lock.release(RWLockMode.READ)
    lock.release(RWLockMode.READ)
    writer.join(WAIT_S)
    assert not writer.is_alive()


def test_a_writer_that_gives_up_lets_the_readers_in_again() -> None:
    lock = RWLock()
    held, done = threading.Event(), threading.Event()

    def hold_read() -> None:
        with lock.hold(RWLockMode.READ, timeout=1):
            held.set()
            done.wait(WAIT_S)

    holder = threading.Thread(target=hold_read)
    holder.start()
    held.wait(WAIT_S)
    try:
        with pytest.raises(RuntimeError, match="deadlock"):
            lock.acquire(RWLockMode.WRITE, timeout=0.2)
        lock.acquire(RWLockMode.READ, timeout=1)  # raises if it waited for the writer that had given up
        lock.release(RWLockMode.READ)
    finally:
        done.set()
        holder.join(WAIT_S)


def test_a_save_is_not_starved_by_a_training_thread_taking_lock_back_to_back(
    manager: CheckpointManager, tmp_path: Path
) -> None:
    weights = torch.zeros(100_000)
    manager.save(str(tmp_path / "warm"), {"model": {"w": weights}}).result(60)  # the writer is up
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set():
            with manager.lock():
                weights.add_(1)  # in place, like optimizer.step()

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        # before: RuntimeError("Failed to acquire the checkpoint write lock after 5 seconds ...") from save()
        future = manager.save(str(tmp_path / "ck"), {"model": {"w": weights}})
        blocked = time.monotonic() - started
        future.result(WAIT_S * 4)
    finally:
        stop.set()
        trainer.join(WAIT_S)
    assert blocked < WAIT_S / 2, blocked
    into = {"model": {"w": torch.zeros(100_000)}}
    manager.load(str(tmp_path / "ck"), into)
    w = into["model"]["w"]
    assert bool((w == w[0]).all()), "the staging copy ran during a lock() holder's update"
    assert float(w[0]) > 0
