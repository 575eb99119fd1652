"""Savers: one write path (`write_checkpoint`), two schedules.

The sync saver writes inline. The async saver copies `requires_copy=True` values on a staging thread (holding
the staging lock, so `CheckpointManager.lock()` waits only for that copy), then hands the request to the
background writer process and resolves the write Future when the commit is durable.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch_checkpointing.agreement import describe
from torch_checkpointing.checkpoint_process import (
    KILLED_EXIT_S,
    CheckpointProcess,
    EncodedWrite,
    encode_write,
    not_for_the_writer,
)
from torch_checkpointing.checkpoint_writer import (
    CheckpointWriterConfig,
    SavePlan,
    WriteEntry,
    committed_before_interrupt,
    finish_for_a_dead_writer,
    refuse_unanswered,
    write_checkpoint,
)
from torch_checkpointing.codecs import refuse_before_handover
from torch_checkpointing.commit import Commit, remove_made
from torch_checkpointing.config import AsyncCheckpointSaverConfig
from torch_checkpointing.errors import (
    CheckpointError,
    CommitError,
    ConfigError,
    WriterProcessDied,
    add_note,
    committed_state,
    log_safely,
    save_shortage,
)
from torch_checkpointing.futures import SettledFuture
from torch_checkpointing.lock import DEFAULT_ACQUIRE_TIMEOUT_SECS, RWLock, RWLockMode
from torch_checkpointing.pickling import (
    OutOfBand,
    dumps_out_of_band,
    fails_at_a_non_tensor,
    raised_by_a_leaf,
    unpicklable,
)
from torch_checkpointing.schema import ResolvedItem
from torch_checkpointing.signals import start_thread
from torch_checkpointing.staging import CheckpointStager, DefaultStager, to_slab_refs
from torch_checkpointing.storage.base_storage import Storage, StorageConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.waiting import Deadline

__all__ = [
    "AsyncCheckpointSaver",
    "CheckpointSaver",
    "SavePlan",
    "SyncCheckpointSaver",
    "WriteFuture",
    "refuse_interrupted_write",
]

logger = logging.getLogger("torch_checkpointing.saver")
# How long a wait that timed out and killed the writer then waits for that write's Future to fail (`_kill_for`).
_FUTURE_AFTER_KILL_S = 10.0


class CheckpointSaver(ABC):
    @abstractmethod
    def save(self, plan: SavePlan) -> Future[Any] | None: ...

    @abstractmethod
    def close(self) -> None: ...

    def lock(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def wait(self, timeout: float | None) -> None:  # noqa: B027  (a hook: savers with nothing in flight keep it)
        """Block until the last write is durable; re-raise its error."""

    def settle_previous(self) -> None:  # noqa: B027  (a hook: sync savers have nothing to settle)
        """Before a new save: wait for the previous one; raise its failure if the caller never saw it."""

    def check_can_save(self, checkpoint_id: str) -> None:  # noqa: B027  (a hook: a sync save needs no lock)
        """Before a new save is planned: refuse one that could never start (it would wait for the caller)."""

    def refuse_unencodable(self, items: list[ResolvedItem]) -> None:  # noqa: B027  (sync: the write refuses)
        """Before a save is planned: raise what the encoding in a writer process would refuse later."""

    def wait_for_write_of(self, checkpoint_id: str) -> None:  # noqa: B027  (sync saves are done on return)
        """Before a load of `checkpoint_id`: wait for this saver's write of it, if one is in flight."""

    def write_in_flight(self) -> str | None:
        """The id of a save still being written, if any (sync saves are done on return)."""
        return None

    def on_callback_thread(self) -> bool:
        """Whether the caller is the thread that runs the save Futures' done-callbacks (sync saves have none):
        a wait there for anything behind the callback waits for itself."""
        return False

    def close_bound_s(self) -> float:
        """The most `close()` takes, and a `wait` past its timeout once it killed the writer (sync: nothing)."""
        return 0.0

    @property
    def stager(self) -> CheckpointStager | None:
        return None


class SyncCheckpointSaver(CheckpointSaver):
    def __init__(self, storage: Storage, writer_config: CheckpointWriterConfig) -> None:
        self._storage = storage
        self._writer_config = writer_config

    def save(self, plan: SavePlan) -> None:
        entries = [WriteEntry(i.key, i.layout.file_path, i.layout.serialization_format, i.value) for i in plan.items]
        try:
            nbytes = write_checkpoint(self._storage, plan.request(entries, self._writer_config))
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C, a signal handler's sys.exit(): the files may be owed
                refuse_interrupted_write(plan, exc)
            log_failed(plan, exc)
            raise
        log_committed(plan, nbytes, blocked_s=time.monotonic() - plan.started)
        return None

    def close(self) -> None:
        return None


class AsyncCheckpointSaver(CheckpointSaver):
    def __init__(
        self,
        config: AsyncCheckpointSaverConfig,
        storage_config: StorageConfig,
        subprocess_init_fn: Any = None,
        subprocess_init_args: tuple[Any, ...] = (),
        *,
        storage: Storage | None = None,
    ) -> None:
        self.config = config
        self._storage_config = storage_config
        # The trainer's own (the manager's, built from the same environment as the writers' storage), else made
        # when a dead writer needs cleaning up after: from the environment of that moment, which may name
        # another store by then.
        self._storage: Storage | None = storage
        self._stager = DefaultStager(config.staging_config)
        self._process = CheckpointProcess(
            storage_config, config.process_config, subprocess_init_fn, subprocess_init_args
        )
        self._stager.before_new_slab = self._process.drop_slab  # the old slab's memory is free only then
        prefix = config.process_config.thread_name_prefix
        self._staging_pool = _DaemonWorker(config.staging_config.thread_name)
        self._comm_thread_name = f"{prefix}-comm"
        self._comm = _DaemonWorker(self._comm_thread_name)
        self._staging_lock = RWLock()
        self._last_write: WriteFuture | None = None
        self._prewarm: Future[Any] | None = None

    @property
    def stager(self) -> DefaultStager:
        return self._stager

    @property
    def process(self) -> CheckpointProcess:
        return self._process

    @property
    def _timeout(self) -> float | None:
        return self.config.wait_timeout_secs

    @property
    def _lock_timeout(self) -> float:
        """How long the staging lock is waited for: `wait_timeout_secs`, or 600 s if None (API_SURFACE §10), so
        a lock() never released is the deadlock error, not a hang."""
        timeout = self.config.wait_timeout_secs
        return DEFAULT_ACQUIRE_TIMEOUT_SECS if timeout is None else timeout

    def lock(self) -> AbstractContextManager[Any]:
        return self._staging_lock.hold(RWLockMode.READ, self._lock_timeout)

    def close_bound_s(self) -> float:
        """A write's writer killed past the timeout (`_kill_for`: its end, then its Future settling), then the
        writer's shutdown."""
        return KILLED_EXIT_S + _FUTURE_AFTER_KILL_S + self._process.shutdown_bound_s()

    def on_callback_thread(self) -> bool:
        return self._comm.is_current()

    def wait(self, timeout: float | None) -> None:
        """Wait (bounded) for the last write; past `timeout` the writer is killed and this raises saying so.

        Re-raises the last write's failure unless the caller already retrieved it from its Future. `timeout`
        bounds both waits together (the prewarm's and the write's), not each.
        """
        deadline = Deadline(timeout)
        if self._prewarm is not None:
            self._prewarm.result(deadline.left())
        write = self._last_write
        if write is None:
            return
        self._comm.run_queued_here()
        try:
            write.quiet_exception(deadline.left())
        except TimeoutError:  # named by save.wait_timeout_secs: `timeout` may be what close() had left of it
            fate = self._kill_for(write, self._timeout)
            if fate is not None:
                raise CheckpointError(
                    f"The checkpoint write of {write.checkpoint_id} did not finish within {self._timeout}s "
                    f"(save.wait_timeout_secs); the writer process was killed and {fate}."
                ) from None
        self._raise_unseen(write, "")

    def _kill_for(self, write: WriteFuture, timeout: float | None) -> str | None:
        """Kill the writer a timed-out wait for `write` gave up on, then wait (bounded) for `write`'s Future to
        settle: the thread that sent it settles it once the pipe breaks. Returns what became of the save, as that
        Future says it, for the wait's error; None when it succeeded (the writer had put the checkpoint in place
        before the kill, and the trainer finished it), which is logged instead: the wait must not call a save
        "not committed" that its Future reports done.

        Before, close() (and the next save()) raised "was not committed" while that Future was still pending, so
        `future.exception(timeout=0)` right after close() raised TimeoutError, for a save just reported failed;
        and then also for a save whose Future, settled, said it was committed."""
        self._process.kill()
        try:
            error = write.quiet_exception(_FUTURE_AFTER_KILL_S)
        except TimeoutError:  # its failure still has to be agreed with other ranks: it resolves on its own
            logger.debug("The killed write of %s had not settled its Future yet", write.checkpoint_id)
            return f"whether {write.checkpoint_id} was committed is not settled yet (its Future says, once it is)"
        if error is None:
            log_safely(
                logger,
                logging.WARNING,
                "The checkpoint write of %s did not finish within %ss (save.wait_timeout_secs) and its writer "
                "process was killed, but the checkpoint was already in place: it is committed, and the save's "
                "Future succeeded.",
                write.checkpoint_id,
                timeout,
            )
            return None
        if getattr(error, "outcome_unknown", False) is True:
            return (
                f"{write.checkpoint_id} may have been committed right before the kill (the id holds its previous "
                f"checkpoint or this one; a load returns one of them whole)"
            )
        return f"{write.checkpoint_id} was not committed"

    def _raise_unseen(self, write: WriteFuture, consequence: str) -> None:
        """Surface a failed save the caller never looked at (its Future was dropped), once."""
        error = write.quiet_exception(0)
        if error is None or write.retrieved:
            return
        write.retrieved = True
        raise CheckpointError(
            f"The async save of {write.checkpoint_id} failed and {committed_state(error)}: "
            f"{type(error).__name__}: {error}.{consequence}"
        ) from error

    def settle_previous(self) -> None:
        self._wait_previous()

    def check_can_save(self, checkpoint_id: str) -> None:
        """A save inside `with manager.lock():` on this thread waits for a lock it holds itself: refused now,
        before any rank plans it (else it waited the whole wait_timeout_secs, then failed on this rank only)."""
        if self._staging_lock.held_by_this_thread():
            raise CheckpointError(
                f"Checkpoint save of {checkpoint_id}: save() was called inside `with manager.lock():` on the same "
                f"thread; its staging copy needs that lock, so it would wait for itself. Nothing was saved. Call "
                f"save() after the with block (lock() is for in-place updates such as optimizer.step())."
            )

    def refuse_unencodable(self, items: list[ResolvedItem]) -> None:
        """A JSON item JSON cannot hold (or that would not load back) and a safetensors item whose names collide
        are refused from save(), as a sync save refuses them, not through the Future once the writer encoded
        them. Cheap: JSON items are small, and only safetensors names are compared, never bytes."""
        for item in items:
            refuse_before_handover(item.layout.serialization_format, item.key, item.value)

    def write_in_flight(self) -> str | None:
        write = self._last_write
        return write.checkpoint_id if write is not None and not write.done() else None

    def wait_for_write_of(self, checkpoint_id: str) -> None:
        """A load reads its own manager's writes: the design document's `save(path, ...)` then
        `load(path, ...)` restores what was just saved, not what the id held before (nor "does not exist").

        Waits (bounded by `wait_timeout_secs`) only when the last write is to that id and still in flight; a
        load of any other id never waits. If that write fails, raises a CheckpointError carrying its error
        (which counts as the caller having seen it): the load would otherwise restore an older checkpoint, or
        none, in silence.
        """
        write = self._last_write
        if write is None or write.done() or not self._same_id(write.checkpoint_id, checkpoint_id):
            return
        self._comm.run_queued_here()
        try:
            error = write.quiet_exception(self._timeout)
        except TimeoutError:
            raise CheckpointError(
                f"Checkpoint load of {write.checkpoint_id}: this manager's async save of that id did not commit "
                f"within {self._timeout}s (save.wait_timeout_secs), and the load waits for it to read what was "
                f"saved; nothing was restored. If this thread holds `with manager.lock():`, the save's staging copy "
                f"waits for that lock: load after the with block."
            ) from None
        if error is not None:
            write.retrieved = True
            raise CheckpointError(
                f"Checkpoint load of {write.checkpoint_id}: this manager's async save of that id, which the load "
                f"waited for, failed and committed nothing ({type(error).__name__}: {error}); nothing was "
                f"restored. Fix the save's failure and save again, or load another id."
            ) from error

    def _wait_previous(self) -> None:
        if self._prewarm is not None:
            self._settle_prewarm()
        if self._last_write is not None:
            self._comm.run_queued_here()
            try:
                self._last_write.quiet_exception(self._timeout)
            except TimeoutError as exc:
                # As wait() does: left alive, a stopped or hung writer refused every later save until close().
                fate = self._kill_for(self._last_write, self._timeout)
                if fate is not None:
                    self._last_write.retrieved = True  # this error reports it; the next save must not raise it
                    raise CheckpointError(
                        f"The previous checkpoint write ({self._last_write.checkpoint_id}) did not finish within "
                        f"{self._timeout}s (save.wait_timeout_secs): the writer process was killed (stopped or "
                        f"hung) and {fate}. This save() was not started; call it again (a new writer process "
                        f"starts)."
                    ) from exc
            self._raise_unseen(self._last_write, " This save() was not started; call it again to retry.")

    def _settle_prewarm(self) -> None:
        """Raise a failed `prewarm_staging` copy once (a TimeoutError if it still runs: it is kept, and waited
        for again). Before, the failed copy was kept and raised by every later save() and by close(): one
        failed prewarm on one rank failed every save of the job, on every rank, for good."""
        assert self._prewarm is not None
        error = self._prewarm.exception(self._timeout)
        self._prewarm = None
        if error is not None:
            raise CheckpointError(
                f"prewarm_staging() failed ({type(error).__name__}: {error}); this save() was not started. Call "
                f"it again: its staging copy is made anew."
            ) from error

    def save(self, plan: SavePlan) -> Future[Any]:
        """Returns once staging has started (or finished, without async staging); the Future ends with the commit.

        The other ranks agreed on the plan and their writers wait for this rank's: a failure before this rank's
        writer gets the save (its staging copy, the staging lock, the previous write) is answered for it
        (`_refused`), so that every rank raises the same `CommitError` at once. Before, this rank raised its own
        error and the others' writers waited the save's whole timeout, then called this rank silent.
        """
        plan = self._absolute(plan)
        try:
            self._refuse_process_local(plan)
            staged = self._staged_for(plan)
        except Exception as exc:
            error = self._refused(plan, exc)
            if error is exc:
                raise
            raise error from exc
        except BaseException as exc:  # Ctrl-C (or a signal handler's SystemExit) while it staged: answered too
            told = self._refused(plan, _interrupted(plan, f", {type(exc).__name__}"))
            add_note(exc, f"The save of {plan.name} was not committed; every other rank raises: {told}")
            raise
        write = WriteFuture(plan.checkpoint_dir)
        try:
            self._last_write = write
            blocked_s = time.monotonic() - plan.started
            self._comm.submit(lambda: self._write(plan, staged, write, blocked_s))
        except BaseException as exc:  # (Ctrl-C) interrupted around the hand-over
            if write.claim():  # the write job had not started, and now never will: the next save must not wait
                write.retrieved = True  # the caller sees this failure: save() raises it
                log_failed(plan, exc)
                write.try_set_exception(exc)
                # Queued here, not by the write job: the interrupt may have landed before that job was queued,
                # and then nobody told the other ranks, whose writers waited the whole timeout.
                how = f", {type(exc).__name__}"
                self._comm.submit(lambda: self._abandon(plan, write, how))
            else:
                log_safely(
                    logger,
                    logging.WARNING,
                    "save() of %s was interrupted (%s) after its write started; the write goes on, and the next "
                    "save() or close() waits for it",
                    plan.name,
                    type(exc).__name__,
                )
            raise
        return write

    def _refuse_process_local(self, plan: SavePlan) -> None:
        """An id in a store that lives in this process alone (`memory://`) cannot be saved from the writer process:
        its `memory://` is another, empty one. Before, the save failed there blaming another rank's disk (and,
        before the writer's mkdir made one level, it "committed" into the writer's memory, and no load found it)."""
        if not self._storage_config.may_be_process_local:
            return
        if self._trainer_storage().process_local(Path(plan.checkpoint_dir)):
            raise ConfigError(
                f"Cannot save {plan.checkpoint_dir} asynchronously: memory:// lives in the memory of one process, and "
                f"an async save writes from its writer process, whose memory:// is another one that nothing here "
                f"sees. Nothing was written. Use SyncCheckpointSaverConfig with memory://, or a store every process "
                f"reaches (a local directory, file://, s3://)."
            )

    def _staged_for(self, plan: SavePlan) -> Future[Any]:
        """Wait for the previous write, take the staging lock and start (or make) the staging copy of `plan`."""
        self._wait_previous()
        release = _ReleaseOnce(self._staging_lock)
        try:  # the acquire inside: a Ctrl-C landing anywhere after it releases the hold (lock.py)
            self._staging_lock.acquire(RWLockMode.WRITE, self._lock_timeout, release)
            payload = {i.key: i.value for i in plan.items if i.spec.requires_copy}
            if self.config.staging_config.use_async_staging:
                staged: Future[Any] = self._staging_pool.call(self._stage, payload, release)
            else:
                staged = SettledFuture()
                staged.set_result(self._stage(payload, release))
        except BaseException:
            release()
            raise
        return staged

    def _absolute(self, plan: SavePlan) -> SavePlan:
        """A local id as the caller means it now: the writer process keeps the working directory it started in.

        A relative id saved after the script's os.chdir() was otherwise written under the old directory, and the
        caller's load of the same id found nothing.
        """
        return replace(
            plan, checkpoint_dir=self._absolute_id(plan.checkpoint_dir), tmp_dir=self._absolute_id(plan.tmp_dir)
        )

    def _same_id(self, written: str, checkpoint_id: str) -> bool:
        """Whether two ids name one checkpoint: locally, one directory however spelled (a symlinked parent)."""
        if written == self._absolute_id(checkpoint_id):
            return True
        return isinstance(self._storage_config, LocalFileSystemStorageConfig) and os.path.realpath(
            written
        ) == os.path.realpath(checkpoint_id)

    def _absolute_id(self, checkpoint_id: str) -> str:
        if not isinstance(self._storage_config, LocalFileSystemStorageConfig):
            return checkpoint_id  # an object store's relative id is a key under its url, not a path
        return os.path.abspath(checkpoint_id)

    def _stage(self, payload: dict[str, Any], release: _ReleaseOnce) -> dict[str, Any]:
        try:
            return dict(self._stager.stage(payload))
        finally:
            release()

    def _write(self, plan: SavePlan, staged: Future[Any], write: WriteFuture, blocked_s: float) -> None:
        """(On the comm thread.) Whatever raises on the way, the Future resolves: its waiter, and the next save,
        would otherwise wait for it until `wait_timeout_secs`."""
        if not write.claim():  # save() was interrupted around the hand-over: it queued `_abandon` itself
            return
        try:
            self._write_and_resolve(plan, staged, write, blocked_s)
        finally:
            if not write.done():
                write.set_exception(
                    CheckpointError(
                        f"The async save of {plan.name} ended without an outcome (see the error logged "
                        f"with it); whether it was committed is not known: load it to check, or save again."
                    )
                )

    def _write_and_resolve(self, plan: SavePlan, staged: Future[Any], write: Future[Any], blocked_s: float) -> None:
        try:
            encoded, slab_info = self._encode(plan, staged)
            self._process.ensure_ready()
        except BaseException as exc:  # the writer saw nothing: the other ranks' writers are told instead
            self._fail_unanswered(plan, write, exc)
            return
        try:
            nbytes = self._process.write(encoded, slab_info)
        except WriterProcessDied as exc:  # it may have died before answering the other ranks, or in the commit
            self._finish_for_a_dead_writer(plan, write, exc, blocked_s)
        except CommitError as exc:  # the ranks' agreed outcome, or rank 0's store lost: nothing left to tell
            self._fail(plan, write, exc)
        except BaseException as exc:  # the writer is done with it; it may not have reached the agreement
            self._fail_unanswered(plan, write, exc)
        else:
            log_committed(plan, nbytes, blocked_s)
            write.set_result(None)

    def _finish_for_a_dead_writer(
        self, plan: SavePlan, write: Future[Any], exc: WriterProcessDied, blocked_s: float
    ) -> None:
        """The writer died in the middle of the save: this rank answers the rest of the commit in its place
        where it can (`finish_for_a_dead_writer`), and the save ends as it did on every other rank."""
        try:
            outcome = finish_for_a_dead_writer(plan, exc, self._trainer_storage) if exc.outcome_unknown else exc
        except BaseException as unexpected:  # the Future must resolve whatever went wrong here
            outcome = unexpected
        if outcome is exc:
            self._fail_unanswered(plan, write, exc)
        elif outcome is not None:
            self._fail(plan, write, outcome)
        else:
            _warn_committed_without_its_writer(plan, exc)
            log_committed(plan, 0, blocked_s)
            write.set_result(None)

    def _abandon(self, plan: SavePlan, write: WriteFuture, how: str = "") -> None:
        """(On the comm thread.) The save() that made this write was interrupted and failed its Future itself
        (`claim`): the writer never gets it. Written anyway, it could commit a save its caller was told had
        failed. The other ranks' writers are told (`how`: ", KeyboardInterrupt")."""
        exc = _interrupted(plan, how)
        if write.try_set_exception(exc):  # the interrupt also cut save()'s own cleanup (and its log) short
            log_failed(plan, exc)
        if refuse_unanswered(plan, exc) is not exc:  # the other ranks' writers are told, and what they wrote goes
            self._discard(plan)
        remove_made(plan.made)

    def _fail_unanswered(self, plan: SavePlan, write: Future[Any], exc: BaseException) -> None:
        """A save this rank's writer will never answer: tell the other ranks (`refuse_unanswered`), then remove
        what was written into its temporary directory (by the dead writer, or by the other ranks)."""
        error: BaseException = exc
        try:
            error = self._refused(plan, exc)
        finally:  # whatever the report or the cleanup did, the Future resolves (its waiter would hang)
            self._fail(plan, write, error)

    def _refused(self, plan: SavePlan, exc: BaseException) -> BaseException:
        """Answer the commit's first agreement with `exc` for this rank's writer, which will never answer it
        (`refuse_unanswered`); returns the error every rank raises, once what was written is removed. A shortage
        (its staging copy, or torch moving it to shared memory to send it, found no room) is named as one
        (`save_shortage`): it was torch's bare RuntimeError "DefaultCPUAllocator: can't allocate memory"."""
        named = save_shortage(exc, plan.checkpoint_dir)
        if named is not None:
            named.__cause__ = exc
        error = refuse_unanswered(plan, named or exc)
        if error is not (named or exc) or isinstance(exc, WriterProcessDied):
            self._discard(plan)
        return error

    def _encode(self, plan: SavePlan, staged: Future[Any]) -> tuple[EncodedWrite, tuple[int, Any] | None]:
        """The write request, pickled for the pipe, and the slab it points into: everything that can fail
        before the writer process is involved."""
        copies = staged.result()
        slab = self._stager.slab
        entries = []
        buffers: list[memoryview] = []
        keep: list[Any] = []
        for item in plan.items:
            fmt = item.layout.serialization_format
            if item.key in copies:
                # Tensors travel as offsets into the shared slab, which the writer maps once.
                value = _slab_refs(item.key, copies[item.key], slab) if slab is not None else copies[item.key]
                entries.append(WriteEntry(item.key, item.layout.file_path, fmt, value))
            else:
                sent, views, storages = _pickle_item(item)
                buffers.extend(views)
                keep.extend(storages)
                entries.append(WriteEntry(item.key, item.layout.file_path, fmt, sent))
        slab_info = (self._stager.generation, self._stager.shared_slab) if slab is not None else None
        request = plan.request(entries, self.config.writer_config, trainer_pid=os.getpid())
        generation = None if slab_info is None else slab_info[0]
        return encode_write(request, generation, tuple(buffers), tuple(keep)), slab_info

    @staticmethod
    def _fail(plan: SavePlan, write: Future[Any], exc: BaseException) -> None:
        """Report the failure, once the parents made for the id are gone (the caller may save again at once)."""
        remove_made(plan.made)
        log_failed(plan, exc)
        write.set_exception(exc)

    def _trainer_storage(self) -> Storage:
        """The trainer's own storage, made the first time a dead writer needs cleaning up or finishing after."""
        if self._storage is None:
            self._storage = self._storage_config.create_storage()
        return self._storage

    def _discard(self, plan: SavePlan) -> None:
        """Remove this save's temporary directory from the trainer: its writer died (SIGKILL, the OOM killer), or
        never got the save while the other ranks' writers wrote theirs into it.

        Left there, every such save kept the bytes written until someone ran gc, and a job whose writer kept
        dying filled the disk. Only rank 0 discards, as the writer does, once every rank answered; an earlier
        checkpoint is never touched (`Commit.discard` removes only this save's own temporary name, or its
        uncommitted prefix).
        """
        if plan.rank != 0:
            return
        try:
            Commit(self._trainer_storage(), plan.target()).discard()
        except Exception as exc:
            log_safely(
                logger,
                logging.ERROR,
                "Could not remove the temporary directory %s of the failed save of %s: %s: %s. Delete it by hand, "
                "or run `torch-checkpointing gc %s` (it removes what dead saves left there).",
                plan.tmp_dir,
                plan.name,
                type(exc).__name__,
                exc,
                os.path.dirname(plan.tmp_dir.rstrip("/")) or ".",
            )

    def prewarm(self, items: list[ResolvedItem]) -> None:
        if self._last_write is not None and not self._last_write.done():
            raise RuntimeError("Cannot prewarm staging while a write is active")  # misuse; API_SURFACE §2.3
        if self._prewarm is not None and not self._prewarm.done():
            raise RuntimeError("Prewarm staging is already active")  # misuse; API_SURFACE §2.3
        payload = {i.key: i.value for i in items if i.spec.requires_copy}
        if not payload:
            return
        if self._staging_lock.held_by_this_thread():
            raise CheckpointError(  # a RuntimeError, as API_SURFACE §2.3 records for a refused prewarm
                "Cannot prewarm staging inside `with manager.lock():` on the same thread: its staging copy needs "
                "that lock. Call prewarm_staging() before or after the with block."
            )
        release = _ReleaseOnce(self._staging_lock)
        if not self._staging_lock_try_write(release):
            raise RuntimeError("Cannot prewarm staging while checkpoint staging is active")  # misuse; §2.3
        try:
            self._prewarm = self._staging_pool.call(self._stage, payload, release)
        except BaseException:
            release()
            raise

    def _staging_lock_try_write(self, release: _ReleaseOnce) -> bool:
        """Take the write side now or never, under `release`'s token: interrupted, `release()` gives it back."""
        try:
            self._staging_lock.acquire(RWLockMode.WRITE, 0, release)
        except RuntimeError:
            return False
        except BaseException:
            release()
            raise
        return True

    def close(self) -> None:
        self._staging_pool.stop(wait=True)  # a copy still running writes into the slab that close() unmaps
        self._comm.stop()
        self._process.close()
        self._stager.close()


def refuse_interrupted_write(plan: SavePlan, exc: BaseException) -> None:
    """This rank leaves its save (`exc`: Ctrl-C, a signal handler's sys.exit()) once the plan was agreed, maybe
    before it answered for its files (which the other ranks' writes wait for): where it has not, it answers with
    its interrupt (`refuse_unanswered`), and every rank raises the same error at once; `exc` gets a note of it.
    Before, the others waited the save's whole timeout, then said this rank "never called save()"."""
    interrupted = CheckpointError(
        f"The save of {plan.name} was interrupted on rank {plan.rank} ({describe(exc)}) once its plan was agreed, "
        f"before its write started; nothing was written. Save again."
    )
    told = refuse_unanswered(plan, interrupted)
    if told is not interrupted:
        add_note(exc, f"The save of {plan.name} was not committed; every other rank raises: {told}")


def _interrupted(plan: SavePlan, how: str = "") -> CheckpointError:
    """Why a save interrupted inside save() (Ctrl-C), before its write started, failed: this rank's reason, as
    the other ranks read it (`refuse_unanswered`). `how`: ", KeyboardInterrupt", where it is known."""
    return CheckpointError(
        f"The save of {plan.name} was interrupted inside save() (rank {plan.rank}{how}) before its write "
        f"started; nothing was written. Save again."
    )


class _ReleaseOnce:
    """One staging copy's hold of the write lock, released by whoever finishes first: the staging copy, or the
    save() that failed before or around handing it over.

    A second release of the write side clears it whoever holds it then: another thread's prewarm_staging() or
    save() that took the lock in between would have its copy run while an optimizer step in `lock()` updates
    the tensors it copies. A failed sync staging copy released it twice.

    The object is the hold's token (`RWLock.acquire(..., token=self)`): made before the acquire, so that a save()
    interrupted anywhere around the acquire releases what it took, and nothing it did not take.
    """

    def __init__(self, lock: RWLock) -> None:
        self._done = False
        self._once = threading.Lock()
        self._lock = lock  # last: `__del__` of one whose __init__ was interrupted finds no `_lock`, and stops there

    def __call__(self) -> None:
        # Marked done only once released: a Ctrl-C landing inside the release leaves it to the next call (the
        # save()'s own cleanup), which a flag set first turned into a no-op, leaking the write side.
        with self._once:
            if self._lock.release(RWLockMode.WRITE, self):  # by this token: a no-op once given back
                self._done = True

    def __del__(self) -> None:
        """A hold whose releaser is gone (an interrupted save() dropped it) is given back: nothing else could."""
        lock = getattr(self, "_lock", None)
        if lock is not None and not self._done and lock.holds_unlocked(self):
            self()


class _DaemonWorker:
    """One long-lived daemon thread running jobs in order: the comm thread that hands each write to the writer,
    and the staging thread that copies a save's tensors.

    Long-lived because starting a thread per save made save() wait in Thread.start() for the new thread's
    handshake, and that thread, already pickling a requires_copy=False payload, held the GIL for up to a
    switch interval (5 ms) before save() could return. A queue hand-off does not wait for the consumer.
    A daemon thread, not an executor: a writer that never answers must not hold up interpreter exit. And the
    Futures it gives (`call`) are `SettledFuture`s, which a Ctrl-C on the caller's thread cannot wedge (an
    executor's are not: see `futures`).
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._start()  # now, so that the first save() does not pay the start either

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, args=(self._jobs,), name=self._name, daemon=True)
        start_thread(self._thread)

    def is_current(self) -> bool:
        """Whether the caller is this worker's thread."""
        return threading.current_thread() is self._thread

    def run_queued_here(self) -> None:
        """On this worker's own thread (a save Future's done-callback, which runs here): run the jobs queued
        behind the current one now. A wait for one of their Futures would otherwise wait for itself."""
        if threading.current_thread() is not self._thread:
            return
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:  # stop() came: the loop ends after the current job, as it would have
                self._jobs.put(None)
                return
            self._run_one(job)

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:  # stopped: a save after close() still gets its (failing) write
            self._jobs = queue.SimpleQueue()
            self._start()
        self._jobs.put(job)

    def call(self, fn: Callable[..., Any], *args: Any) -> SettledFuture[Any]:
        """Run `fn(*args)` on the thread, after the jobs queued before it; the Future holds its outcome."""
        future: SettledFuture[Any] = SettledFuture()

        def job() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        self.submit(job)
        return future

    def stop(self, wait: bool = False) -> None:
        """Ends the thread after the queued jobs; waits for them only if asked (close() bounds its own waits)."""
        thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            self._thread = None
            if wait and thread is not threading.current_thread():
                thread.join()

    @staticmethod
    def _run(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            _DaemonWorker._run_one(job)
            # Not kept while waiting for the next: a done job still held the last save's staged tree (the old
            # staging slab stayed mapped, and a new layout's slab needed room beside it) and its payload.
            del job

    @staticmethod
    def _run_one(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException:  # a job reports through its own Future; this keeps the thread for the next save
            log_safely(
                logger,
                logging.ERROR,
                "A checkpoint write job failed outside its Future; the next save still runs",
                exc_info=True,
            )


class WriteFuture(SettledFuture[Any]):
    """The Future of one async save; remembers whether the caller looked at its outcome.

    A failure nobody retrieved (the usual loop keeps only the last Future) is raised by the next `save()` or by
    `close()`; `quiet_exception` lets the engine itself look without counting as the caller.
    """

    def __init__(self, checkpoint_id: str) -> None:
        super().__init__()
        self.checkpoint_id = checkpoint_id
        self.retrieved = False
        self._claim = threading.Lock()
        self._claimed = False

    def claim(self) -> bool:
        """Whether this caller is the first to claim the write: the write job when it starts, or the save()
        that queued it, failing (Ctrl-C) before it returned. Exactly one of them resolves the Future."""
        with self._claim:
            first, self._claimed = not self._claimed, True
            return first

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            self.retrieved = self.retrieved or self.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        finally:
            self.retrieved = self.retrieved or self.done()

    def quiet_exception(self, timeout: float | None) -> BaseException | None:
        return super().exception(timeout)

    def mirror(self) -> Future[Any]:
        """A Future with the same outcome, for engine-internal callbacks (they must not count as the caller)."""
        copy: SettledFuture[Any] = SettledFuture()

        def settle(done: Future[Any]) -> None:
            error = self.quiet_exception(0)
            if error is None:
                copy.set_result(None)
            else:
                copy.set_exception(error)

        self.add_done_callback(settle)
        return copy


def _warn_committed_without_its_writer(plan: SavePlan, died: WriterProcessDied) -> None:
    """A save done although its writer process died in it: a WARNING, naming that writer (`died` does), so that a
    writer that keeps dying (the OOM killer) is noticed before it costs a save."""
    if plan.world_size == 1:
        what = (
            f"died after it swapped {plan.name} into place: the checkpoint is committed (the trainer "
            f"finished what the writer left: the replaced checkpoint's removal, the parent's fsync)"
        )
    else:
        what = (
            f"of rank {plan.rank} died after it had written its files for {plan.name}, and the checkpoint "
            f"is committed with them (rank 0 published it)"
        )
    log_safely(
        logger,
        logging.WARNING,
        "The checkpoint writer process %s, so the save is done; a new writer is started for the next save. What "
        "the trainer saw: %s",
        what,
        died,
    )


def log_committed(plan: SavePlan, nbytes: int, blocked_s: float) -> None:
    """`blocked_s`: how long save() held the caller (measured after the plan was made, so not part of it)."""
    durable_s = time.monotonic() - plan.started
    log_safely(
        logger,
        logging.INFO,
        "Checkpoint %s committed (rank %d): %d bytes, save() blocked %.0f ms, durable after %.2f s, %.1f MB/s",
        plan.name,
        plan.rank,
        nbytes,
        blocked_s * 1000,
        durable_s,
        nbytes / max(durable_s, 1e-9) / 1e6,
    )


def log_failed(plan: SavePlan, exc: BaseException) -> None:
    """Never raises (`log_safely`): the failed save's own error is what its caller and its Future get."""
    if committed_before_interrupt(exc):  # a signal handler's exception, raised once the save was in place
        log_safely(
            logger,
            logging.WARNING,
            "Checkpoint save of %s (rank %d) was interrupted right after its commit; the checkpoint is in place: "
            "%s: %s",
            plan.name,
            plan.rank,
            type(exc).__name__,
            exc,
        )
        return
    log_safely(
        logger,
        logging.ERROR,
        "Checkpoint save of %s failed (rank %d); %s: %s: %s",
        plan.name,
        plan.rank,
        committed_state(exc),
        type(exc).__name__,
        exc,
    )


def _slab_refs(key: str, staged: Any, slab: Any) -> Any:
    """`to_slab_refs`, naming the item when a tensor the slab cannot hold does not pickle (an mkldnn tensor: a
    bare NotImplementedError on the Future before, where a sync save names the item), or a staged copy of a
    value taken whole does not (its copy holds a lock): that one is refused as the writer's pickle refuses it,
    not as a tensor."""
    try:
        return to_slab_refs(staged, slab)
    except (pickle.PicklingError, TypeError, AttributeError, KeyError, NotImplementedError, RuntimeError) as exc:
        if fails_at_a_non_tensor(staged, pickle.dumps):
            raise not_for_the_writer(key, staged, exc) from exc
        raise unpicklable(
            key,
            staged,
            exc,
            doing="pickled for the async writer process (a tensor the staging slab cannot hold travels by value)",
            op=pickle.dumps,
            fix="Make it picklable (an mkldnn tensor: .to_dense()), or leave it out of the checkpoint.",
        ) from exc


def _pickle_item(item: ResolvedItem) -> tuple[OutOfBand, list[memoryview], list[Any]]:
    """Not the tensor-sharing pickle: the caller's object is never moved to shared memory. Its tensors' bytes
    travel out of band, written to the pipe from their own memory (`dumps_out_of_band`), and a tensor of a
    dtype plain pickle cannot give back (uint16, float8_*, ...) still arrives whole."""
    try:
        return dumps_out_of_band(item.value)
    except Exception as exc:
        fix = (
            "Async saves need every value to pickle; make it picklable, or use "
            "CheckpointManager.Config.with_sync_save()."
        )
        named = raised_by_a_leaf(
            item.key,
            item.value,
            exc,
            doing="pickled for the async writer process (requires_copy=False)",
            op=pickle.dumps,
            fix=fix,
        )
        if named is not None:
            raise named from exc
        raise pickle.PicklingError(
            f"Item '{item.key}' (requires_copy=False) cannot be pickled for the async writer process: "
            f"{type(exc).__name__}: {exc}. Async saves need every value to pickle; make it picklable, or use "
            f"CheckpointManager.Config.with_sync_save()."
        ) from exc
