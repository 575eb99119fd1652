"""Writing one rank's share of a checkpoint, and taking part in its commit.

Every rank writes its item files under the commit's root (see `commit.py`) and fsyncs them; the ranks then
agree (`agreement.py`, over the TCPStore hosted by rank 0's trainer) on every rank's file records, rank 0
publishes the checkpoint, and the ranks agree on that outcome, so every rank's save ends only after the commit
and a failure anywhere is the same `CommitError` on every rank. The same function runs inline for sync saves
and in the background writer process for async ones.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import time
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_checkpointing.agreement import Contribution, StoreTransport, agree, raise_if_failed
from torch_checkpointing.checkpoint_layout import SerializationFormat
from torch_checkpointing.checksum import FileChecksum, RunningChecksum
from torch_checkpointing.commit import Commit, CommitTarget, MadeDirectory
from torch_checkpointing.config import CheckpointWriterConfig
from torch_checkpointing.distributed_metadata import METADATA_FILE_NAME as METADATA_JSON
from torch_checkpointing.encoding import encode
from torch_checkpointing.errors import (
    CommitError,
    CommitOutcomeUnknownError,
    WriterProcessDied,
    add_note,
    log_safely,
    save_shortage,
)
from torch_checkpointing.futures import WorkerPool
from torch_checkpointing.manifest import FileRecord, Manifest
from torch_checkpointing.pickling import OutOfBand
from torch_checkpointing.signals import Held, handlers_replaced, signal_name, signals_deferred
from torch_checkpointing.storage.base_storage import Storage, StorageConfig
from torch_checkpointing.store_channel import StoreAddress, StoreChannel
from torch_checkpointing.types import RankInfo
from torch_checkpointing.version import __version__

if TYPE_CHECKING:  # the writer process never needs the item specs, only their annotation
    from torch_checkpointing.schema import ResolvedItem

__all__ = [
    "METADATA_JSON",
    "CheckpointWriter",
    "CheckpointWriterArgs",
    "CheckpointWriterConfig",
    "SavePlan",
    "WriteEntry",
    "WriteRequest",
    "committed_before_interrupt",
    "explained_disk_fault",
    "refuse_unanswered",
    "write_checkpoint",
]

logger = logging.getLogger("torch_checkpointing.writer")
# Told the digest of the manifest about to be written (`_publish`): how a writer process's trainer learns it.
Announce = Callable[[str], None]
# After a failed save, how long rank 0 keeps the store up for the other ranks to read the outcome.
_VERDICT_GRACE_S = 2.0
_FILE_POOL = WorkerPool(1, "ckpt-file")  # grown to the writes at once (map_bounded)

# What a held signal is told as: the create of a file (an fsspec backend's open may go over the network and hang),
# and after a Ctrl-C the wait for the write threads, each of which ends only with its file (a large file on a slow
# disk: minutes), then the removal of the unfinished save.
_REMOVAL_HELD = Held(
    "the removal of the unfinished save",
    "it is removed",
    "what is not removed yet stays beside the id until `torch-checkpointing gc` removes it",
)
_CREATE_HELD = Held(
    "the create of the file",
    "it is created and recorded as this save's",
    "the file may stay beside the id until `torch-checkpointing gc` removes it",
)
_WRITES_HELD = Held(
    "the wait for the files being written",
    "they are written and the unfinished save removed",
    "a file still being written may stay beside the id until `torch-checkpointing gc` removes it",
)


@dataclass
class WriteEntry:
    key: str
    file_path: str  # relative to the checkpoint directory, {rank} already filled in
    fmt: SerializationFormat
    value: Any  # an OutOfBand for a requires_copy=False value on its way to the writer process


@dataclass(frozen=True, kw_only=True)
class SavePlan:
    """Everything one rank needs to write and commit one checkpoint, fixed once the ranks agreed on it.

    Built once per save by the manager; the savers turn `items` into `WriteEntry`s, and the writer (inline, or
    in the writer process) reads the rest. `items` hold the caller's values, so the copy that travels in a
    `WriteRequest` has none (`for_writer`).
    """

    checkpoint_dir: str
    tmp_dir: str  # where the files are written before the commit moves them to `checkpoint_dir`
    rank: int
    world_size: int
    items: tuple[ResolvedItem, ...] = ()
    metadata_json: str | None = None  # rank 0 only
    store: StoreAddress | None = None  # None: single rank, no coordination
    timeout_s: float = 600.0
    # Called as f(final_path, event_logger) before the commit and after it; must pickle for async saves.
    pre_finalize_callback: Callable[[str, Any], None] | None = None
    finalize_callback: Callable[[str, Any], None] | None = None
    step: int | None = None
    metrics: dict[str, float] | None = None
    overwrite: bool = True  # may replace an existing checkpoint of ours (never anything else)
    started: float = field(default_factory=time.monotonic)  # when save() was called
    made: tuple[MadeDirectory, ...] = ()  # the id's parents this save created (rank 0): a failure removes them
    # How messages name the checkpoint where that is not `checkpoint_dir`: an object store's URL (`shown_name`).
    shown: str = ""

    @property
    def name(self) -> str:
        """The checkpoint as messages name it: the URL `load` and the CLI take on an object store, else the id."""
        return self.shown or self.checkpoint_dir

    def target(self) -> CommitTarget:
        return CommitTarget(self.checkpoint_dir, self.tmp_dir, self.overwrite, self.made)

    def for_writer(self) -> SavePlan:
        """This plan without its items: their values travel as the request's entries instead."""
        return replace(self, items=()) if self.items else self

    def request(
        self, entries: list[WriteEntry], writer_config: CheckpointWriterConfig, trainer_pid: int | None = None
    ) -> WriteRequest:
        return WriteRequest(self.for_writer(), entries, writer_config.file_write_max_threads, trainer_pid)


@dataclass
class WriteRequest:
    """One write, as the writer gets it: the plan, each item's value to encode, and the writer's own settings.

    Crosses to the writer process for async saves, so everything in it pickles.
    """

    plan: SavePlan
    entries: list[WriteEntry]
    file_write_max_threads: int = 1
    trainer_pid: int | None = None  # async saves: the trainer that asked; the writer commits only while it lives


class _ChecksumStream:
    """Forwards writes to `inner`, checksumming them (size, CRC32, block CRC32s) for the manifest."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._running = RunningChecksum()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._running.update(view)
        self.inner.write(view)
        return len(view)

    def flush(self) -> None:
        self.inner.flush()

    def checksum(self) -> FileChecksum:
        return self._running.result()


def _open_owned(commit: Commit, target: Path, stack: ExitStack) -> tuple[Any, tuple[int, int] | None]:
    """The stream that creates `target`, entered in `stack` and recorded as this save's (a local file: the
    discard checks it is still this one before removing it). A Ctrl-C between the create and the record left a
    file the discard took for another program's, and with it the temporary directory; a signal meanwhile is
    handled once both are done. The stream is entered before that: a handler that raises there leaves its
    `with` as any failure does (closed, an upload discarded). Before, the stream was returned and the signal
    raised before the save entered it: it was never closed nor discarded, and a local file's descriptor stayed
    open on the removed file as long as the exception lived (for good in a notebook, which keeps it)."""
    with signals_deferred(f"creating {target}", held=_CREATE_HELD):
        raw = stack.enter_context(commit.storage.stream_write(target))
        identity = getattr(raw, "identity", None)
        if identity is not None:
            commit.own(target, identity)
    return raw, identity


def _write_entry(commit: Commit, rank: int, entry: WriteEntry) -> FileRecord:
    value = entry.value.loads() if isinstance(entry.value, OutOfBand) else entry.value
    target = commit.root / entry.file_path
    with ExitStack() as stack:
        raw, identity = _open_owned(commit, target, stack)
        # Streams that checksum what they write (the local filesystem's off the encoding thread, the object
        # store's on its upload threads) are used as they are; any other backend's stream is wrapped.
        stream: Any = raw if callable(getattr(raw, "checksum", None)) else _ChecksumStream(raw)
        encode(entry.fmt, entry.key, value, stream)
    summed: FileChecksum = stream.checksum()  # complete now: the stream was closed
    if identity is not None:
        commit.own(target, identity, summed.size)
    return FileRecord(
        entry.key, rank, entry.file_path, summed.size, summed.crc32, entry.fmt.to_dict(), blocks=summed.blocks
    )


def _write_local_files(storage: Storage, request: WriteRequest, commit: Commit) -> list[FileRecord]:
    root, rank = commit.root, request.plan.rank
    names = [posixpath.normpath(entry.file_path) for entry in request.entries]
    if request.plan.metadata_json is not None:
        names.append(METADATA_JSON)
    commit.begin(rank, names)
    directories = {root}
    for entry in request.entries:
        parent = root / posixpath.dirname(entry.file_path)
        if parent not in directories:
            commit.make_directory(parent)
            directories.add(parent)
    if request.file_write_max_threads > 1 and len(request.entries) > 1:
        # A process-wide pool: a sync save writes from the training thread, where a Ctrl-C must not wedge it.
        records = _FILE_POOL.map_bounded(
            lambda e: _write_entry(commit, rank, e), request.entries, request.file_write_max_threads, _WRITES_HELD
        )
    else:
        records = [_write_entry(commit, rank, e) for e in request.entries]
    for directory in sorted(directories, key=lambda p: len(p.parts), reverse=True):
        storage.sync_directory(directory)
    return records


def _check_distinct(records: list[FileRecord]) -> None:
    by_path: dict[str, FileRecord] = {}
    for rec in records:
        other = by_path.get(posixpath.normpath(rec.path))
        if other is not None:
            raise CommitError(
                f"Item '{other.key}' on rank {other.rank} and item '{rec.key}' on rank {rec.rank} both wrote "
                f"{rec.path!r}; put '{{rank}}' in the layout's file_path so that every rank has its own file.",
                {other.rank: f"wrote {rec.path!r}", rec.rank: f"wrote {rec.path!r}"},
            )
        by_path[posixpath.normpath(rec.path)] = rec


def _publish(
    commit: Commit,
    request: WriteRequest,
    records: list[FileRecord],
    channel: StoreChannel | None = None,
    announce: Announce | None = None,
) -> None:
    """Rank 0: the manifest over every rank's records, then the commit itself. The manifest's digest goes first to
    `announce` (an async writer's trainer) and, on several ranks, in the store, for the trainer to tell whether it
    is in place should this writer die (`Commit.adopt`)."""
    plan = request.plan
    _check_distinct(records)
    metadata = plan.metadata_json.encode("utf-8") if plan.metadata_json is not None else None
    manifest = Manifest(
        plan.world_size,
        __version__,
        tuple(records),
        METADATA_JSON if metadata is not None else None,
        plan.step,
        plan.metrics,
        time.time(),
        len(metadata) if metadata is not None else None,
        zlib.crc32(metadata) if metadata is not None else None,
    )

    def before_writing(digest: str) -> None:
        if channel is not None:
            channel.publish(_manifest_key(plan), digest)
        if announce is not None:
            announce(digest)

    commit.publish(manifest, plan.metadata_json, lambda: _check_trainer_alive(request), before_writing)


def _check_trainer_alive(request: WriteRequest) -> None:
    """A writer whose trainer is gone must not commit: a newer save of the same id may already be in place."""
    plan = request.plan
    if request.trainer_pid is not None and os.getppid() != request.trainer_pid:
        raise CommitError(
            f"Checkpoint {plan.name} was not committed: the trainer process {request.trainer_pid} that "
            f"asked for it is gone."
        )


@dataclass
class _Progress:
    committed: bool = False
    # The ranks agreed on every rank's files and this rank is not rank 0: rank 0 commits the save without it.
    left_to_rank_0: bool = False


def write_checkpoint(storage: Storage, request: WriteRequest, announce: Announce | None = None) -> int:
    """Write this rank's files and take part in the commit; returns once the checkpoint is durable.

    Returns the bytes this rank wrote. On failure the unfinished save is removed where this rank owns the
    outcome (single rank, or rank 0); it never becomes visible at the checkpoint's path either way. Once the
    checkpoint is committed nothing is reported as a failure: a failed `finalize_callback` is logged.
    `announce` (the writer process's pipe to its trainer) gets the manifest's digest before it is written; if it
    raises, nothing is published.
    """
    plan = request.plan
    commit = Commit(storage, plan.target())
    commit.others_write = plan.world_size > 1
    progress = _Progress()
    raised: list[tuple[int, BaseException]] = []  # what a signal handler raised during the write (see _as_reported)
    try:
        with handlers_replaced(lambda signum, handler: _recording(handler, raised)):
            try:
                nbytes = _write_and_commit(storage, request, commit, progress, announce)
            except BaseException:
                if not raised:
                    raise
                committed = progress.committed or commit.is_committed()
                # What torch.save made of the handler's exception was only a consequence of it.
                raise _as_reported(raised[0], plan.name, committed, progress.left_to_rank_0) from None
    except BaseException as exc:
        committed = _clean_up(commit, plan, progress, exc)
        explained = None if committed else _explained(exc, plan.checkpoint_dir)
        reported = exc if explained is None else explained
        if commit.outcome_unknown and isinstance(reported, Exception):  # its report: "it may have been committed"
            setattr(reported, "outcome_unknown", True)  # noqa: B010 - not an attribute of every exception class
        if explained is not None:
            raise explained from exc
        raise
    if plan.finalize_callback is not None:
        try:
            plan.finalize_callback(plan.checkpoint_dir, None)
        except Exception:  # committed: a save does not fail after its commit (the design document's rule)
            log_safely(
                logger,
                logging.ERROR,
                "finalize_callback failed for the committed checkpoint %s",
                plan.name,
                exc_info=True,
            )
    return nbytes


def _clean_up(commit: Commit, plan: SavePlan, progress: _Progress, exc: BaseException) -> bool:
    """After `exc`, remove the unfinished save where this rank owns the outcome; returns whether it committed.

    A second Ctrl-C (or a preemption handler's exception) landing here left the unfinished save half removed
    beside the id: its handler runs once the clean-up is done (a third one interrupts it). Python's own Ctrl-C
    handler then raises a bare KeyboardInterrupt, which replaced the save's report of what became of it: the
    report is raised in its place (that handler did run; a Ctrl-C pressed again is the same interrupt). The
    report names the signal whose handler raised it (`raised`): before, every one was "Ctrl-C", a SIGTERM
    handled by `signal.default_int_handler` too.
    """
    committed = progress.committed
    raised: list[tuple[int, BaseException]] = []
    try:
        with (
            handlers_replaced(lambda signum, handler: _recording(handler, raised)),
            signals_deferred(f"removing the unfinished save of {plan.name}", held=_REMOVAL_HELD),
        ):
            committed = committed or commit.is_committed()
            if plan.rank == 0 and not committed:
                commit.discard()
    except KeyboardInterrupt as again:
        if type(again) is not KeyboardInterrupt or again.args:
            raise  # a handler's own KeyboardInterrupt says what it says
        if not isinstance(exc, KeyboardInterrupt):
            signum = next((n for n, e in raised if e is again), None)
            raise _as_reported((signum, again), plan.name, committed, progress.left_to_rank_0) from exc
        # else the caller raises `exc` (the first Ctrl-C, reported) as it is
    return committed


# What a disk fault means for the save, and what to do about it; `{parent}` is the checkpoint's directory.
_DISK_FAULT_FIXES = {
    errno.ENOSPC: "the filesystem holding {parent} is out of space or inodes: free some there (delete old "
    "checkpoints; `torch-checkpointing gc {parent}` removes what failed saves left), then save again",
    errno.EDQUOT: "the disk quota for {parent} is used up: free some of it or raise the quota, then save again",
    errno.EFBIG: "a file reached the file-size limit (`ulimit -f`, RLIMIT_FSIZE) or the filesystem's maximum "
    "file size: raise the limit, or split the state into more items (one file each), then save again",
    errno.EROFS: "{parent} is on a read-only filesystem: save under a writable directory, or remount it read-write",
    errno.EACCES: "this process may not write there: check the owner and mode of {parent} and of the "
    "checkpoint id's own directory, or save under another directory",
    errno.EPERM: "the filesystem refused the operation: check the attributes (`lsattr -d`: immutable or "
    "append-only) and permissions of {parent} and of the checkpoint id's own directory, or save elsewhere",
}


def explained_disk_fault(exc: BaseException, checkpoint_dir: str) -> OSError | None:
    """`exc` again (same type, errno and paths) with what failed and the fix, if it is a disk fault we can name.

    The bare OS error named only a file inside the hidden temporary directory: not the checkpoint, nor
    whether the earlier one survived, nor what to do.
    """
    if not isinstance(exc, OSError) or exc.errno not in _DISK_FAULT_FIXES or not exc.strerror:
        return None
    parent = os.path.dirname(os.path.abspath(checkpoint_dir))
    fix = _DISK_FAULT_FIXES[exc.errno].format(parent=parent)
    said = (
        f"{exc.strerror} (checkpoint {checkpoint_dir} was not committed; an earlier checkpoint under that id, "
        f"if any, is intact. Fix: {fix})"
    )
    return OSError(exc.errno, said, exc.filename, None, exc.filename2)


def _explained(exc: BaseException, checkpoint_dir: str) -> BaseException | None:
    """A failed save's error named for what it is, when we can: a disk fault, or the process short of memory,
    a thread or descriptors (`errors.save_shortage`)."""
    return explained_disk_fault(exc, checkpoint_dir) or save_shortage(exc, checkpoint_dir)


def _recording(handler: Callable[..., Any], raised: list[tuple[int, BaseException]]) -> Callable[[int, Any], None]:
    """`handler`, remembering what it raised (Python's default SIGINT handler raises a bare KeyboardInterrupt)."""

    def recorded(signum: int, frame: Any) -> None:
        try:
            handler(signum, frame)
        except BaseException as exc:
            raised.append((signum, exc))
            raise

    return recorded


def _as_reported(
    signalled: tuple[int | None, BaseException], checkpoint_dir: str, committed: bool, left_to_rank_0: bool = False
) -> BaseException:
    """The exception a signal handler raised in the middle of a save, saying what became of the save.

    A Python signal handler's exception (Ctrl-C's KeyboardInterrupt, a preemption handler's sys.exit() on
    SIGTERM) raised inside torch.save came out as torch's zip-writer RuntimeError ("unexpected pos"), which reads
    like disk corruption, and a SystemExit lost its exit status. Ctrl-C under Python's default handler becomes a
    KeyboardInterrupt whose message says it (`signum` None: which signal's handler raised it is not known, and
    the message does not guess Ctrl-C); any other handler's own exception is raised as itself, with a note
    (and a log line) saying it. (`committed`: the signal may land after the swap, which replaced any earlier
    checkpoint: the message then says the new one is in place. `left_to_rank_0`: the ranks had agreed on every
    rank's files, so rank 0 commits the save without this rank, which cannot tell whether it has yet: before, this
    rank said "nothing was committed" of a checkpoint rank 0 put in place a moment later.)
    """
    signum, exc = signalled
    if committed:  # the swap has replaced any earlier checkpoint: it is not "intact" any more
        state = "it was committed before the signal landed; the new checkpoint is in place"
    elif left_to_rank_0:
        state = (
            f"the ranks had agreed on every rank's files, so rank 0 commits it without this rank: {checkpoint_dir} "
            f"holds either its earlier checkpoint or this one, whole (load it to check)"
        )
    else:
        state = f"nothing was committed at {checkpoint_dir}; an earlier checkpoint there, if any, is intact"
    what = signal_name(signum) if signum is not None else type(exc).__name__
    said = f"Checkpoint save of {checkpoint_dir} interrupted by {what}: {state}."
    if type(exc) is KeyboardInterrupt and not exc.args:  # Python's own Ctrl-C: the message is ours to give
        exc = KeyboardInterrupt(said)
    else:
        log_safely(logger, logging.WARNING, "%s (the signal handler raised %s)", said, type(exc).__name__)
        add_note(exc, said)
    setattr(exc, _COMMITTED_ATTR, committed)
    if left_to_rank_0 and not committed:
        exc.outcome_unknown = True  # type: ignore[attr-defined]  # `committed_state` words the log line by it
    return exc


_COMMITTED_ATTR = "_torch_checkpointing_committed_before_interrupt"


def committed_before_interrupt(exc: BaseException) -> bool:
    """Whether `exc` is a signal handler's exception that landed after its save had committed (`_as_reported`
    found so): the save's failure log must not say that nothing was committed."""
    return getattr(exc, _COMMITTED_ATTR, False) is True


def _write_and_commit(
    storage: Storage, request: WriteRequest, commit: Commit, progress: _Progress, announce: Announce | None
) -> int:
    plan = request.plan
    before_commit = plan.pre_finalize_callback
    if plan.store is None:
        mine = _write_local_files(storage, request, commit)
        if before_commit is not None:
            before_commit(plan.checkpoint_dir, None)
        _publish(commit, request, mine, announce=announce)
        progress.committed = True
        return sum(r.size for r in mine)
    channel = StoreChannel(plan.store, plan.timeout_s)
    transport = StoreTransport(plan.rank, plan.world_size, channel)
    records: list[FileRecord] = []

    def write() -> list[dict[str, Any]]:
        local = [r.to_dict() for r in _write_local_files(storage, request, commit)]
        if before_commit is not None:
            before_commit(plan.checkpoint_dir, None)
        return local

    def publish() -> None:
        if plan.rank == 0:
            _publish(commit, request, records, channel, announce)
            progress.committed = True

    try:
        written = _agree_on_the_files(plan, transport, write, progress)
        progress.left_to_rank_0 = plan.rank != 0
        records.extend(FileRecord.from_dict(d) for report in written for d in report)
        _agree_on_the_commit(plan, transport, channel, publish)
        progress.committed = True
    finally:
        _settle(channel, plan, progress.committed)
    return sum(r.size for r in records if r.rank == plan.rank)


def _agree_on_the_files(
    plan: SavePlan, transport: StoreTransport, write: Callable[[], list[dict[str, Any]]], progress: _Progress
) -> list[list[dict[str, Any]]]:
    """The files step: every rank's file records.

    A rank that leaves it (Ctrl-C, a signal handler's sys.exit()) once its files are written may find that the
    step succeeded all the same (another rank decided so first, and rank 0 goes on to commit): it then says that
    rank 0 commits the save without it, and answers the commit step with its interrupt so that the others hear it
    at once. Before, it said "nothing was committed" of the checkpoint rank 0 put in place, and rank 0 waited the
    save's whole timeout for its answer to the commit.
    """
    wrote = False

    def written() -> list[dict[str, Any]]:
        nonlocal wrote
        records = write()
        wrote = True
        return records

    step = _files_step(plan)
    try:
        return agree(step, transport, written)
    except Exception:
        raise
    except BaseException as exc:
        if wrote and transport.agreed_as_it_left(step, exc):
            progress.left_to_rank_0 = plan.rank != 0
            transport.leave_before(_commit_step(plan), exc)
        raise


def _agree_on_the_commit(
    plan: SavePlan, transport: StoreTransport, channel: StoreChannel, publish: Callable[[], None]
) -> None:
    """The commit step: rank 0 publishes the checkpoint, every rank hears that it did.

    A rank that went silent after rank 0 published (its writer killed, its host gone) changes nothing about what
    the id holds: the checkpoint is committed, and the design document's rule is that nothing is reported as a
    failure then. Before, every surviving rank raised "rank(s) [k] did not report ... No checkpoint was
    committed" for a checkpoint that was in place and loaded whole. It is logged at WARNING instead. Where rank 0
    itself did not answer, whether it published is not known here, and the error says so.
    """
    step = _commit_step(plan)
    try:
        agree(step, transport, publish)
    except CommitError as exc:
        rank_0 = _rank_0s_answer(channel, step)
        if rank_0 is None or not Contribution.from_json(rank_0).ok:
            if 0 in exc.failures and rank_0 is None:
                reasons = "; ".join(f"rank {r}: {why}" for r, why in sorted(exc.failures.items()))
                raise CommitOutcomeUnknownError(
                    f"Checkpoint {plan.name}: rank 0 did not say whether it committed ({reasons}). The "
                    f"id holds either its previous checkpoint or this one, and a load returns one of them whole; "
                    f"save again to be sure of this step's state.",
                    exc.failures,
                ) from exc
            raise
        log_safely(
            logger,
            logging.WARNING,
            "Checkpoint %s is committed (rank 0 published it), but not every rank answered after that: %s",
            plan.name,
            exc,
        )


def _rank_0s_answer(channel: StoreChannel, step: str) -> str | None:
    """What rank 0 answered to the commit step, if it did and its store (its trainer) is still there to say so.

    A store gone with rank 0's trainer is no answer: before, its "lost contact with rank 0 ... No checkpoint was
    committed by this save" escaped from here, although rank 0's writer may have published just before.
    """
    try:
        return channel.wait_value(f"{step}/0", 0)
    except CommitError:
        return None


def _files_step(plan: SavePlan) -> str:
    """The first agreement of a multi-rank commit: every rank's file records, or why it has none."""
    return f"Checkpoint {plan.checkpoint_dir}: writing the files"


def _commit_step(plan: SavePlan) -> str:
    """The second agreement: rank 0 publishes the checkpoint, every rank hears that it did."""
    return f"Checkpoint {plan.checkpoint_dir}: the commit"


def _manifest_key(plan: SavePlan) -> str:
    """Where rank 0's writer puts the digest of the manifest it is about to write (`_publish`), beside the commit
    step's answers."""
    return f"{_commit_step(plan)}/manifest"


def refuse_unanswered(plan: SavePlan, exc: BaseException) -> BaseException:
    """Report a save whose writer never answered the commit's first agreement; returns the error for this
    rank's Future.

    The save failed on this rank before its writer got it (a value that cannot travel to the writer process, a
    failed staging copy, a writer that cannot start), or the writer died before it answered (SIGKILL, the OOM
    killer): the other ranks' writers waited for this rank the save's whole timeout, then called it silent.
    Answering the agreement with the failure makes every rank raise the same `CommitError` at once, naming this
    rank and its reason. A writer that answered before it died is left to the commit's own timeout; single rank:
    `exc` itself, the clearest. Only call this once the writer can no longer answer (never sent, or dead).
    """
    if plan.store is None:
        return exc

    def failed() -> list[dict[str, Any]]:
        raise exc

    step = _files_step(plan)
    try:
        channel, answered = _answered_the_files_step(plan, plan.store)
    except CommitError as lost:  # rank 0's store is gone: the others cannot be waiting on it either
        return lost
    if answered:
        return exc
    try:
        agree(step, StoreTransport(plan.rank, plan.world_size, channel), failed)
    except CommitError as agreed:
        return agreed
    finally:
        _settle(channel, plan, committed=False)
    return exc  # not reached: a failed contribution always makes the agreement raise


def finish_for_a_dead_writer(
    plan: SavePlan, exc: WriterProcessDied, storage: Callable[[], Storage]
) -> BaseException | None:
    """(In the trainer.) This rank's writer died after it answered the commit's first agreement (its files written
    and synced): take the rest of the commit in its place. None when the checkpoint was committed; else the error
    every rank raises. `exc` itself where this cannot stand in (a writer that had not answered yet:
    `refuse_unanswered` is for that one; a trainer that cannot look at the id). `storage` makes the trainer's own,
    which only rank 0 (or the only rank) needs, and only then. A single rank settles alone (`_settle_alone`).

    Before, such a rank raised "died during the write ... the id holds its previous checkpoint, or this one", and
    the others waited the save's whole timeout for the dead writer. On a rank other than 0, what the writer had
    left is no write: answer the commit step (its part of it is empty) and acknowledge the outcome. On rank 0 it
    may have been anywhere in the commit itself: what the id holds decides (`_stand_in_for_rank_0`).
    """
    if plan.store is None:
        return _settle_alone(plan, exc, storage)
    step = _files_step(plan)
    try:
        channel, answered = _answered_the_files_step(plan, plan.store)
    except CommitError as lost:  # rank 0's store is gone with its trainer: nothing is left to agree with
        return lost
    if not answered:
        return exc
    try:
        commit = Commit(storage(), plan.target()) if plan.rank == 0 else None
    except Exception as blind:  # it cannot look at the id: the outcome stays unknown, as it was before
        log_safely(
            logger,
            logging.WARNING,
            "Rank 0's trainer cannot look at %s for its dead writer (%s: %s): the other ranks hear nothing from rank "
            "0 and give up after save.wait_timeout_secs.",
            plan.name,
            type(blind).__name__,
            blind,
        )
        return exc
    committed = False
    transport = StoreTransport(plan.rank, plan.world_size, channel)
    try:
        raise_if_failed(step, transport.answers(step))
        publish = _stand_in_for_rank_0(plan, commit, channel, exc) if commit is not None else lambda: None
        _agree_on_the_commit(plan, transport, channel, publish)
        committed = True
    except CommitError as agreed:
        if commit is not None and not commit.is_committed():  # what the writer would have removed, had it lived
            commit.discard()
        return agreed
    finally:
        _settle(channel, plan, committed)
    return None


def _settle_alone(plan: SavePlan, died: WriterProcessDied, storage: Callable[[], Storage]) -> BaseException | None:
    """(Single rank.) What became of the save whose writer process died in the middle of it, from what the id
    holds: None when the checkpoint the writer announced (`died.manifest_digest`) is in place (what the writer
    left after the swap is finished here); else what the save wrote is removed, and the error says it was not
    committed. `died` itself where the trainer cannot look at the id (no storage of its own).

    Before, such a save ended "the id holds its previous checkpoint, or this one" even once the checkpoint was
    swapped into place: with no store, the trainer did not know which manifest its writer was writing.
    """
    try:
        commit = Commit(storage(), plan.target())
    except Exception as blind:  # it cannot look at the id: the outcome stays unknown, as it was before
        log_safely(
            logger,
            logging.WARNING,
            "The trainer cannot look at %s for its dead checkpoint writer (%s: %s): whether the save was committed "
            "stays unknown.",
            plan.name,
            type(blind).__name__,
            blind,
        )
        return died
    try:
        if commit.adopt(died.manifest_digest, died.pid):
            return None
    except CommitOutcomeUnknownError as unknown:  # it could not read the id: the outcome stays unknown
        log_safely(logger, logging.WARNING, "%s", unknown)
        return died
    said = died.if_not_committed or (
        f"Checkpoint {plan.name} was NOT committed: its writer process died before the checkpoint was in "
        f"place. The trainer removes what the save wrote; an earlier checkpoint at that id is intact. Save again."
    )
    return WriterProcessDied(said)


def _stand_in_for_rank_0(
    plan: SavePlan, commit: Commit, channel: StoreChannel, died: WriterProcessDied
) -> Callable[[], None]:
    """Rank 0's answer to the commit step, for its writer that died after every rank's files were in.

    Where that writer answered the step before it died, the same answer again (the other ranks may have read it).
    Else the id decides (`Commit.adopt`, told which manifest the writer was writing): this save in place is
    committed, and the trainer finishes what came after the swap; anything short of that is removed, and the
    commit fails on every rank alike, an earlier checkpoint at the id intact. Not the commit redone: the trainer
    never makes visible what its writer did not.
    """
    step = _commit_step(plan)
    answered = _rank_0s_answer(channel, step)

    def publish() -> None:
        if answered is not None:
            said = Contribution.from_json(answered)
            if not said.ok:
                raise CommitError(str(said.error))
            return
        if commit.adopt(channel.wait_value(_manifest_key(plan), 0), died.pid):
            return
        log_safely(
            logger,
            logging.WARNING,
            "Rank 0's checkpoint writer process died in the commit of %s before the checkpoint was in place: it is "
            "not committed, and its trainer removed what the save wrote. What the trainer saw: %s",
            plan.name,
            died,
        )
        raise CommitError(
            "its checkpoint writer process died before the checkpoint was in place (the WARNING logged on rank 0 "
            "says how); what this save wrote was removed and an earlier checkpoint at this id is intact. Save "
            "again; if writers keep dying, look for the OOM killer (dmesg) or whatever else kills them"
        )

    return publish


def _answered_the_files_step(plan: SavePlan, store: StoreAddress) -> tuple[StoreChannel, bool]:
    """A channel to rank 0's store, and whether this rank's writer answered the commit's first agreement (which
    of `refuse_unanswered` and `finish_for_a_dead_writer` stands in for it); `CommitError` if the store is gone."""
    channel = StoreChannel(store, plan.timeout_s)
    return channel, plan.rank not in channel.missing(_files_step(plan), plan.world_size)


def _settle(channel: StoreChannel, plan: SavePlan, committed: bool) -> None:
    """Rank 0's trainer hosts the store: rank 0 waits until every live rank has read the outcome."""
    try:
        channel.publish(f"ack/{plan.rank}", "seen")
        if plan.rank == 0:
            timeout = plan.timeout_s if committed else _VERDICT_GRACE_S
            channel.gather("ack", plan.world_size, "that it saw the outcome", timeout_s=timeout, outcome="")
    except CommitError as exc:  # a rank (or the store) gone after the outcome changes nothing about it
        log_safely(
            logger,
            logging.DEBUG,
            "Rank %d: not every rank acknowledged the outcome of %s: %s",
            plan.rank,
            plan.name,
            exc,
        )


# ------------------------------------------------------------------------------------------- compatibility
# `CheckpointWriterArgs`/`CheckpointWriter` are kept importable for code written against the published API
# (API_SURFACE.md); the engine itself never uses them. `TMP_PREFIX` is inert: temporary names come from commit.py.


@dataclass
class CheckpointWriterArgs:
    config: CheckpointWriterConfig
    rank_info: RankInfo
    storage_config: StorageConfig
    pre_finalize_callback: Callable[[str, Any], None] | None = None
    finalize_callback: Callable[[str, Any], None] | None = None
    metric_prefix: str = "train.checkpoint_write"

    def __post_init__(self) -> None:
        if self.metric_prefix != "train.checkpoint_write":
            from torch_checkpointing.config import warn_ignored

            warn_ignored(self, "CheckpointWriterArgs.metric_prefix", "the engine reports no metrics; leave it unset.")

    def build(self) -> CheckpointWriter:
        return CheckpointWriter(self)


class CheckpointWriter:
    """Compatibility only: a storage plus the callbacks to attach to each request."""

    TMP_PREFIX = "tmp_"

    def __init__(self, args: CheckpointWriterArgs) -> None:
        self.args = args
        self.storage = args.storage_config.create_storage()

    def write(self, request: WriteRequest) -> int:
        plan = request.plan
        request.plan = replace(
            plan,
            pre_finalize_callback=plan.pre_finalize_callback or self.args.pre_finalize_callback,
            finalize_callback=plan.finalize_callback or self.args.finalize_callback,
        )
        return write_checkpoint(self.storage, request)
