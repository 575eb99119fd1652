"""Savers: one write path (`write_checkpoint`), two schedules.

The sync saver writes inline. The async saver copies `requires_copy=True` values on a staging thread (holding
the staging lock, so `CheckpointManager.lock()` waits only for that copy), then hands the request to the
background writer process and resolves the write Future when the commit is durable.
"""

from __future__ import annotations

import pickle
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch_checkpointing.checkpoint_process import CheckpointProcess
from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig, WriteEntry, WriteRequest, write_checkpoint
from torch_checkpointing.config import AsyncCheckpointSaverConfig
from torch_checkpointing.lock import RWLock, RWLockMode
from torch_checkpointing.schema import ResolvedItem
from torch_checkpointing.staging import CheckpointStager, DefaultStager, to_slab_refs
from torch_checkpointing.storage.base_storage import Storage, StorageConfig
from torch_checkpointing.store_channel import StoreAddress

__all__ = ["CheckpointSaver", "SyncCheckpointSaver", "AsyncCheckpointSaver", "SavePlan"]


@dataclass
class SavePlan:
    """Everything one rank needs to write and commit one checkpoint."""

    checkpoint_dir: str
    tmp_dir: str
    rank: int
    world_size: int
    items: list[ResolvedItem]
    metadata_json: str | None
    store: StoreAddress | None
    timeout_s: float
    pre_finalize_callback: Callable[[str, Any], None] | None = None
    finalize_callback: Callable[[str, Any], None] | None = None
    step: int | None = None
    metrics: dict[str, float] | None = None

    def request(self, entries: list[WriteEntry], writer_config: CheckpointWriterConfig) -> WriteRequest:
        return WriteRequest(
            self.checkpoint_dir,
            self.tmp_dir,
            self.rank,
            self.world_size,
            entries,
            self.metadata_json,
            self.store,
            self.timeout_s,
            writer_config.file_write_max_threads,
            self.pre_finalize_callback,
            self.finalize_callback,
            self.step,
            self.metrics,
        )


class CheckpointSaver(ABC):
    @abstractmethod
    def save(self, plan: SavePlan) -> Future[Any] | None: ...

    @abstractmethod
    def close(self) -> None: ...

    def lock(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def wait(self, timeout: float | None) -> None:
        """Block until the last write is durable; re-raise its error."""

    @property
    def stager(self) -> CheckpointStager | None:
        return None


class SyncCheckpointSaver(CheckpointSaver):
    def __init__(self, storage: Storage, writer_config: CheckpointWriterConfig) -> None:
        self._storage = storage
        self._writer_config = writer_config

    def save(self, plan: SavePlan) -> None:
        entries = [WriteEntry(i.key, i.layout.file_path, i.layout.serialization_format, i.value) for i in plan.items]
        write_checkpoint(self._storage, plan.request(entries, self._writer_config))
        return None

    def close(self) -> None:
        return None


class AsyncCheckpointSaver(CheckpointSaver):
    def __init__(
        self,
        config: AsyncCheckpointSaverConfig,
        storage_config: StorageConfig,
        subprocess_init_fn: Any = None,
        subprocess_init_args: tuple = (),
    ) -> None:
        self.config = config
        self._stager = DefaultStager(config.staging_config)
        self._process = CheckpointProcess(storage_config, config.process_config, subprocess_init_fn, subprocess_init_args)
        prefix = config.process_config.thread_name_prefix
        self._staging_pool = ThreadPoolExecutor(1, thread_name_prefix=config.staging_config.thread_name)
        self._comm_pool = ThreadPoolExecutor(1, thread_name_prefix=f"{prefix}-comm")
        self._staging_lock = RWLock()
        self._last_write: Future[Any] | None = None
        self._prewarm: Future[Any] | None = None
        self._state = threading.Lock()

    @property
    def stager(self) -> DefaultStager:
        return self._stager

    @property
    def process(self) -> CheckpointProcess:
        return self._process

    @property
    def _timeout(self) -> float | None:
        return self.config.wait_timeout_secs

    def lock(self) -> AbstractContextManager[Any]:
        return self._staging_lock.hold(RWLockMode.READ, self._timeout)

    def wait(self, timeout: float | None) -> None:
        for fut in (self._prewarm, self._last_write):
            if fut is not None:
                fut.result(timeout)

    def _wait_previous(self) -> None:
        if self._prewarm is not None:
            self._prewarm.result(self._timeout)
            self._prewarm = None
        if self._last_write is not None:
            try:
                self._last_write.exception(self._timeout)
            except TimeoutError as exc:
                raise RuntimeError(
                    f"The previous checkpoint write did not finish within {self._timeout}s "
                    f"(save.wait_timeout_secs); refusing to start another."
                ) from exc

    def save(self, plan: SavePlan) -> Future[Any]:
        """Returns once staging has started (or finished, without async staging); the Future ends with the commit."""
        self._wait_previous()
        self._staging_lock.acquire(RWLockMode.WRITE, self._timeout)
        try:
            payload = {i.key: i.value for i in plan.items if i.spec.requires_copy}
            if self.config.staging_config.use_async_staging:
                staged: Future[Any] = self._staging_pool.submit(self._stage, payload)
            else:
                staged = Future()
                staged.set_result(self._stage(payload))
        except BaseException:
            self._staging_lock.release(RWLockMode.WRITE)
            raise
        write: Future[Any] = Future()
        write.set_running_or_notify_cancel()
        self._last_write = write
        self._comm_pool.submit(self._write, plan, staged, write)
        return write

    def _stage(self, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            return dict(self._stager.stage(payload))
        finally:
            self._staging_lock.release(RWLockMode.WRITE)

    def _write(self, plan: SavePlan, staged: Future[Any], write: Future[Any]) -> None:
        try:
            copies = staged.result()
            slab = self._stager.slab
            entries = []
            for item in plan.items:
                fmt = item.layout.serialization_format
                if item.key in copies:
                    # Tensors travel as offsets into the shared slab, which the writer maps once.
                    value = to_slab_refs(copies[item.key], slab) if slab is not None else copies[item.key]
                    entries.append(WriteEntry(item.key, item.layout.file_path, fmt, value))
                else:
                    entries.append(WriteEntry(item.key, item.layout.file_path, fmt, _pickle_item(item), pickled=True))
            slab_info = (self._stager.generation, self._stager.shared_slab) if slab is not None else None
            self._process.write(plan.request(entries, self.config.writer_config), slab_info)
        except BaseException as exc:
            write.set_exception(exc)
        else:
            write.set_result(None)

    def prewarm(self, items: list[ResolvedItem]) -> None:
        if self._last_write is not None and not self._last_write.done():
            raise RuntimeError("Cannot prewarm staging while a write is active")
        if self._prewarm is not None and not self._prewarm.done():
            raise RuntimeError("Prewarm staging is already active")
        payload = {i.key: i.value for i in items if i.spec.requires_copy}
        if not payload:
            return
        if not self._staging_lock_try_write():
            raise RuntimeError("Cannot prewarm staging while checkpoint staging is active")
        self._prewarm = self._staging_pool.submit(self._stage, payload)

    def _staging_lock_try_write(self) -> bool:
        try:
            self._staging_lock.acquire(RWLockMode.WRITE, timeout=0)
        except RuntimeError:
            return False
        return True

    def close(self) -> None:
        self._staging_pool.shutdown(wait=True)
        self._comm_pool.shutdown(wait=True, cancel_futures=True)
        self._process.close()
        self._stager.close()


def _pickle_item(item: ResolvedItem) -> bytes:
    """Plain pickle (not the tensor-sharing one): the caller's object is never moved to shared memory."""
    try:
        return pickle.dumps(item.value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise pickle.PicklingError(
            f"Item '{item.key}' (requires_copy=False) cannot be pickled for the async writer process: "
            f"{type(exc).__name__}: {exc}. Async saves need every value to pickle; make it picklable, or use "
            f"CheckpointManager.Config.with_sync_save()."
        ) from exc
