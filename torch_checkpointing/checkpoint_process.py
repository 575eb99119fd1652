"""The background writer process of async saves.

Spawned (not forked: a forked CUDA or threaded trainer is unsafe to copy) once per manager, started at
construction so the first save rarely waits for it. Requests arrive over a pipe with staged tensors in shared
memory (passed by handle, not copied); every message is a dataclass of the protocol below, and each write is
answered with `Written` or `Failed` (carrying the original exception object). The process
survives a failed write, and is restarted if it dies.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal

import torch.multiprocessing  # noqa: F401  (registers tensor reductions: shared-memory tensors pass by handle)

from torch_checkpointing.checkpoint_writer import WriteRequest, write_checkpoint
from torch_checkpointing.commit import working_directory_is_not_the_programs
from torch_checkpointing.config import CheckpointProcessConfig
from torch_checkpointing.errors import CheckpointError, WriterProcessDied, add_note
from torch_checkpointing.pickling import OutOfBand, callback_unpicklable, unpicklable
from torch_checkpointing.signals import start_thread
from torch_checkpointing.staging import from_slab_refs
from torch_checkpointing.storage.base_storage import StorageConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import store_environment
from torch_checkpointing.store_channel import let_go_of_clients
from torch_checkpointing.waiting import Deadline, Flag

__all__ = ["CheckpointProcess", "CheckpointProcessConfig", "EncodedWrite", "WriterProcessDied", "encode_write"]

logger = logging.getLogger("torch_checkpointing.process")


def _noop(*args: Any) -> None:
    return None


def _portable(exc: BaseException) -> BaseException:
    """The exception itself when it pickles (so the caller sees the original type), else a RuntimeError."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        add_note(exc, f"(raised in the checkpoint writer process)\n{tb}")  # on 3.10 lost, the type kept
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"Checkpoint writer process failed:\n{tb}")


def _skip_torch_record_crc() -> None:
    """The manifest's CRC32 covers each whole file; torch's per-record CRC would checksum every byte twice."""
    try:
        import torch.utils.serialization

        torch.utils.serialization.config.save.compute_crc32 = False
    except (ImportError, AttributeError):  # torch < 2.7 has no such switch
        pass


# Signals a job's whole process group receives: a terminal's Ctrl-C, a scheduler's preemption notice (SLURM and
# torchrun's agent signal every process of the job or of each worker's group). The trainer decides on them.
_GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _leave_group_signals_to_the_trainer(trainer_pid: int) -> None:
    """A Ctrl-C or a preemption SIGTERM reaches the writer with its trainer: the trainer decides, and a trainer
    that waits for its in-flight save (on KeyboardInterrupt, in a SIGTERM handler) gets it. Before, SIGTERM
    killed the writer mid-write and the save was lost however the trainer handled it.

    The writer starts with both signals blocked (see `_spawn_with_group_signals_blocked`). SIGINT is then
    ignored and unblocked (a Ctrl-C that came meanwhile is dropped). SIGTERM stays blocked and one thread takes
    each: from the trainer (multiprocessing terminating its children at exit) it ends the writer as before; from
    anyone else it is logged and left to the trainer. A trainer that dies anyway takes its writer with it
    (`_die_with_trainer`).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - POSIX has it
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # also if not inherited (a resource tracker restart)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    if hasattr(signal, "sigwaitinfo"):
        start_thread(threading.Thread(target=_take_sigterm, args=(trainer_pid,), name="ckpt-sigterm", daemon=True))


def _take_sigterm(trainer_pid: int) -> None:
    while True:
        info = signal.sigwaitinfo([signal.SIGTERM])
        if info.si_pid == trainer_pid:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])  # die of it as before (exit code -15)
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            return
        logger.info(
            "The checkpoint writer got SIGTERM from pid %s and goes on: its trainer (pid %s) decides; a save in "
            "flight completes unless the trainer ends first.",
            info.si_pid,
            trainer_pid,
        )


def _spawn_with_group_signals_blocked(proc: Any) -> None:
    """`proc.start()` from this (spawning) thread with SIGINT and SIGTERM blocked in it, which the child inherits.

    The spawned writer imports torch for seconds before `_leave_group_signals_to_the_trainer` runs: a Ctrl-C
    then killed it (a KeyboardInterrupt in the import, or torch's C++ aborting on one), and the first save, which
    the trainer may finish on Ctrl-C before it exits, failed with "writer killed by SIGINT". Only this
    short-lived thread blocks them: the trainer's main thread still gets its KeyboardInterrupt at once.
    multiprocessing's resource tracker is started first, as the start would: starting it unblocks both signals
    in the calling thread.
    """
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - POSIX has it
        proc.start()
        return
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_SIGNALS)
    proc.start()


def _die_with_trainer(trainer_pid: int, poll_s: float = 0.2) -> None:
    """An orphaned writer exits at once: committing for a trainer that is gone could replace a newer save.

    (PR_SET_PDEATHSIG would fire when the *thread* that spawned us exits, and we are spawned from a short-lived
    thread, so the parent is watched instead; `write_checkpoint` checks it again right before the commit.)
    """

    def watch() -> None:
        while os.getppid() == trainer_pid:
            time.sleep(poll_s)
        os._exit(1)

    start_thread(threading.Thread(target=watch, name="ckpt-trainer-watch", daemon=True))


# ------------------------------------------------------------------------------------------- the protocol
# Every message on the pipe is one of these dataclasses (pickled by multiprocessing; tensors in shared memory
# travel as handles). Trainer -> writer: MapSlab, DropSlab, Incoming + Write, Stop. Writer -> trainer: Ready (or
# StartFailed), SlabDropped, Taken, Publishing, Written or Failed, Stopped.


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class StartFailed:
    """The writer's set-up raised (`step` names which part); sent instead of `Ready`, and the writer exits."""

    step: str
    error: BaseException


@dataclass(frozen=True)
class MapSlab:
    """The staging slab that later requests' SlabRefs point into; sent once per generation."""

    generation: int
    tensor: Any


_DROP_SLAB_WAIT_S = 30.0  # an idle writer unmaps at once; a stopped one must not hold up the save


@dataclass(frozen=True)
class DropSlab:
    """Unmap the staging slab: the trainer is about to allocate another (the state's layout changed), and the
    old one's memory is free only once neither process maps it. Answered with `SlabDropped`."""


@dataclass(frozen=True)
class SlabDropped:
    """The writer no longer maps a staging slab."""


@dataclass(frozen=True)
class Taken:
    """The writer has read a whole `Write` and starts on it. A writer that dies before sending this has written
    nothing for that request, so the trainer can hand it to a new writer; one that dies after may have committed."""


@dataclass(frozen=True)
class Publishing:
    """Sent in the middle of a write, right before the writer writes anything of the checkpoint's manifest: that
    manifest's digest (`commit.manifest_digest`). A writer that dies from then on may have swapped the checkpoint
    into place; the trainer compares the manifest at the id with this to tell whether it did (`Commit.adopt`).
    One that dies before sending it had published nothing. Before, a single-rank save whose writer died in the
    commit ended "the id holds its previous checkpoint, or this one": only the writer knew its manifest."""

    digest: str


@dataclass(frozen=True)
class Incoming:
    """Sent right before each `Write`: how many bytes its pickle has, and how many bytes of out-of-band buffers
    follow that. Both travel raw, after this message.

    A request that pickled here may not unpickle in the writer (a callback's class defined under the script's
    `if __name__ == "__main__":`, a `__reduce__` whose load raises), and the writer may have no memory for it.
    The writer then cannot know its buffers' sizes from it, yet must read them all for the next message to
    start where the trainer put it. The pickle's own size is known before it is allocated: `recv_bytes()` raised
    `MemoryError` in the middle of the message, the writer died, and the save went to a new writer.
    """

    data_bytes: int
    buffer_bytes: int


@dataclass
class Write:
    request: WriteRequest
    slab_generation: int | None  # the slab the request's SlabRefs point into, None when it has none


@dataclass(frozen=True)
class EncodedWrite:
    """A `Write` already pickled on the trainer's side (what `Connection.send` does inside `write()` otherwise).

    The saver encodes before the hand-over, so a value that cannot travel fails while the writer has seen
    nothing: on several ranks that failure can then be reported to the other ranks' writers, which would
    otherwise wait for this rank until the save's timeout (`CheckpointProcess.write` takes either form).
    """

    checkpoint_dir: str
    slab_generation: int | None
    data: memoryview
    # The out-of-band buffers of the request's `OutOfBand` entries, in entry order, sent right after `data`;
    # `keep` holds the storages they view until then.
    buffers: tuple[memoryview, ...] = ()
    keep: tuple[Any, ...] = ()
    request: WriteRequest | None = None  # what `data` pickles, to pickle anew for another writer (`_for_a_new_writer`)


def encode_write(
    request: WriteRequest,
    slab_generation: int | None,
    buffers: tuple[memoryview, ...] = (),
    keep: tuple[Any, ...] = (),
) -> EncodedWrite:
    """Pickle one write for the pipe; a value that cannot be pickled is a `PicklingError` naming its item."""
    try:
        data = ForkingPickler.dumps(Write(request, slab_generation))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise _unpicklable(request) or pickle.PicklingError(
            "The checkpoint write request cannot be pickled for the async writer process."
        ) from exc
    except Exception as exc:  # a value's own __reduce__ may raise anything: named when an item's value does
        named = _unpicklable(request)
        if named is None:
            raise
        raise named from exc
    return EncodedWrite(request.plan.checkpoint_dir, slab_generation, data, buffers, keep, request)


def _for_a_new_writer(encoded: EncodedWrite) -> EncodedWrite:
    """`encoded` pickled anew, for the writer that gets it after the first died before it took it.

    A tensor in shared memory travels as a file descriptor that multiprocessing's resource sharer hands out
    once, to the first process that asks: a writer that read the request and died before it took it (in the
    middle of its out-of-band buffers) had taken them, and the second writer, sent the same bytes, died in
    EOFError unpickling them, so the save that was to be retried failed as "died before it took the write".
    """
    if encoded.request is None:
        return encoded
    return encode_write(encoded.request, encoded.slab_generation, encoded.buffers, encoded.keep)


def _send_buffers(fd: int, buffers: tuple[memoryview, ...]) -> None:
    """Each buffer's bytes, straight from its memory (os.write releases the GIL: the trainer goes on)."""
    for buffer in buffers:
        view = buffer
        while view:
            view = view[os.write(fd, view) :]


def _receive_buffers(fd: int, message: Write) -> BaseException | None:
    """Read the out-of-band buffers that follow `message` on the pipe into its `OutOfBand` entries. Every byte
    is read whatever fails (the next message must start where the trainer put it); a failure (no memory for a
    buffer) is returned, for the reply, after the last byte."""
    failed: BaseException | None = None
    for entry in message.request.entries:
        value = entry.value
        if not isinstance(value, OutOfBand):
            continue
        value.received = []
        for size in value.sizes:
            if failed is None:
                try:
                    buffer = bytearray(size)
                except MemoryError as exc:
                    failed = exc
                else:
                    _read_into(fd, memoryview(buffer))
                    value.received.append(buffer)
                    continue
            _discard(fd, size)
    return failed


def _receive_write(conn: Connection, incoming: Incoming) -> Write | BaseException:
    """The `Write` that follows `incoming`, its buffers read; or why it cannot be served, once every byte of it
    is read. Before, a request that did not unpickle here killed the writer (its traceback on stderr), was taken
    for one killed before it took the request and went to a second writer, which died the same way: the save
    failed with "died (exit code 1) before it took the write", naming neither the cause nor the fix."""
    fd = conn.fileno()
    try:
        data = bytearray(incoming.data_bytes)
    except MemoryError as exc:  # told to the trainer, which names the checkpoint and the fix
        _discard(fd, incoming.data_bytes + incoming.buffer_bytes)
        return exc
    _read_into(fd, memoryview(data))
    try:
        message = ForkingPickler.loads(data)
    except MemoryError as exc:  # no room to unpickle: a shortage, not a class the writer cannot rebuild
        _discard(fd, incoming.buffer_bytes)
        return exc
    except Exception as exc:
        _discard(fd, incoming.buffer_bytes)
        return _not_loadable(exc)
    del data
    failed = _receive_buffers(fd, message)
    return message if failed is None else failed


def _not_loadable(exc: Exception) -> CheckpointError:
    error = CheckpointError(
        f"The save's write request pickled in the training process but could not be unpickled in the writer "
        f"process ({type(exc).__name__}: {exc}); nothing was written. A pre_finalize_callback, finalize_callback or "
        f"requires_copy=True value in it is of a class the writer process cannot rebuild: one defined under the "
        f"script's `if __name__ == '__main__':` (the spawned writer imports the script without running that block) "
        f"or in a notebook, or one whose __reduce__/__setstate__ raises on load. Define it at module level of an "
        f"importable module, or use CheckpointManager.Config.with_sync_save()."
    )
    error.__cause__ = exc
    return error


def _read_into(fd: int, view: memoryview) -> None:
    while view:
        n = os.readv(fd, [view])
        if n == 0:
            raise EOFError("the trainer closed the pipe in the middle of a write request's buffers")
        view = view[n:]


# What `_discard` reads into, made with the module: a discard follows a request the writer had no memory for, and
# its own 1 MiB buffer, refused under a tight RLIMIT_AS, killed the writer in the middle of the request.
_SCRATCH = memoryview(bytearray(1 << 16))


def _discard(fd: int, size: int) -> None:
    while size:
        chunk = _SCRATCH[: min(len(_SCRATCH), size)]
        _read_into(fd, chunk)
        size -= len(chunk)


@dataclass(frozen=True)
class Written:
    nbytes: int  # what this rank wrote


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Stopped:
    pass


def _serve(storage: Any, message: Write, slab: MapSlab | None, conn: Connection) -> Written | Failed:
    """One write, answered with its outcome; the process stays up for the next save either way. The trainer
    hears which manifest is being published before it is written (`Publishing`)."""
    try:
        request = message.request
        if message.slab_generation is not None:
            if slab is None or slab.generation != message.slab_generation:
                raise CheckpointError(
                    f"The writer process has staging slab {None if slab is None else slab.generation}, but the "
                    f"request for {request.plan.checkpoint_dir} points into slab {message.slab_generation}."
                )
            for entry in request.entries:
                if not isinstance(entry.value, OutOfBand):
                    entry.value = from_slab_refs(entry.value, slab.tensor)
        return Written(write_checkpoint(storage, request, lambda digest: conn.send(Publishing(digest))))
    except BaseException as exc:
        return Failed(_portable(exc))


def _writer_main(
    conn: Connection,
    storage_config: StorageConfig,
    environment: dict[str, str],
    init_fn: Callable[..., None],
    init_args: tuple[Any, ...],
) -> None:
    if not _start_threads(conn, os.getppid()):
        return
    _take_store_environment(environment)
    working_directory_is_not_the_programs()
    _skip_torch_record_crc()
    storage = _set_up(conn, storage_config, init_fn, init_args)
    if storage is None:
        return
    if not _answer(conn, Ready(os.getpid())):
        return
    slab: MapSlab | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer is gone; with a reply of ours unread, as ECONNRESET, not EOF
            return
        if isinstance(message, Stop):
            let_go_of_clients()  # its connections to rank 0's store close before the trainer hears it stopped
            _answer(conn, Stopped())
            _exit_now()
        elif isinstance(message, MapSlab):
            slab = message
        elif isinstance(message, DropSlab):
            slab = None  # the mapping goes with its last reference: this one (the request's views went with it)
            gc.collect()
            if not _answer(conn, SlabDropped()):
                return
        elif isinstance(message, Incoming):
            try:
                received = _receive_write(conn, message)
            except (EOFError, OSError):
                return  # the trainer went away in the middle of the request: nobody is left to answer
            if not _answer(conn, Taken()):
                return
            if isinstance(received, Write):
                reply: Written | Failed = _serve(storage, received, slab, conn)
            else:
                reply = Failed(_portable(received))
            del received  # drop shared-memory handles before answering
            if not _answer(conn, reply):
                return
        else:  # no reply: the trainer reads a reply only after a Write, and would take this one for the next
            logger.error("The checkpoint writer got an unknown message %s; it is dropped", type(message).__name__)


def _take_store_environment(environment: dict[str, str]) -> None:
    """Make the store variables (`store_environment`) those the manager was built with, before the caller's init
    function (which may set its own) and the storage are run and built: a writer spawned again after one died
    took the trainer's environment of that moment, and wrote where AWS_ENDPOINT_URL pointed by then while the
    manager's own storage read the store it was built for."""
    for name in store_environment().keys() - environment.keys():
        del os.environ[name]
    os.environ.update(environment)


def _answer(conn: Connection, message: Any) -> bool:
    """Send to the trainer; False when it is gone (killed while this writer started or wrote): the writer then
    ends quietly, as it does when the trainer's end of the pipe reads EOF. A SIGKILLed or SIGTERMed job's
    writer printed a BrokenPipeError traceback under "Process ckpt-writer", as if the writer had failed."""
    try:
        conn.send(message)
    except OSError:  # BrokenPipeError, ConnectionResetError: nobody reads the other end any more
        return False
    return True


def _start_threads(conn: Connection, trainer_pid: int) -> bool:
    """The writer's own threads (`_leave_group_signals_to_the_trainer`, `_die_with_trainer`); False once their
    refusal was sent to the trainer. Before, a thread the OS refused (RLIMIT_AS, RLIMIT_NPROC) killed the writer
    with a bare RuntimeError on its stderr, and the trainer read only an EOF: the save failed with "EOFError",
    telling the user to guard the script's entry point."""
    try:
        _leave_group_signals_to_the_trainer(trainer_pid)
        _die_with_trainer(trainer_pid)
    except BaseException as exc:  # a MemoryError from `start_thread`, naming the shortage and the fix
        with contextlib.suppress(OSError):
            conn.send(StartFailed("starting the writer's own threads", _portable(exc)))
        return False
    return True


def _set_up(
    conn: Connection, storage_config: StorageConfig, init_fn: Callable[..., None], init_args: tuple[Any, ...]
) -> Any:
    """Run the caller's init function, then build the storage; None once a failure was sent to the trainer.

    Without this the child died with its traceback on its own stderr, and the trainer read only an EOFError.
    """
    step = f"subprocess_init_fn ({_name_of(init_fn)})"
    try:
        init_fn(*init_args)
        step = f"storage_config.create_storage() ({type(storage_config).__name__})"
        return storage_config.create_storage()
    except BaseException as exc:  # SystemExit from an init function too: the trainer must learn why
        with contextlib.suppress(OSError):
            conn.send(StartFailed(step, _portable(exc)))
        return None


def _name_of(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _exit_now() -> None:
    """Exit without interpreter teardown once `Stopped` is sent: every write has been answered (so committed
    and fsynced, or failed), and tearing down torch and the storage in a spawned child took seconds of the
    trainer's close(). Logs and std streams are flushed first; nothing else holds state worth finalising."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(0)


def _unpicklable(request: WriteRequest) -> Exception | None:
    """Name the item whose staged value, or the callback, that cannot travel to the writer process (None: none
    fails). A callback found picklable when it was set may have stopped pickling since (a lock added to a callable
    object): the write was then refused as a whole, naming neither the callback nor the fix."""
    for name in ("pre_finalize_callback", "finalize_callback"):
        error = callback_unpicklable("CheckpointManager.Config", name, getattr(request.plan, name), cached=False)
        if error is not None:
            return error
    for entry in request.entries:
        try:
            ForkingPickler.dumps(entry.value)
        except Exception as exc:
            return not_for_the_writer(entry.key, entry.value, exc)
    return None


def not_for_the_writer(key: str, value: Any, exc: BaseException) -> pickle.PicklingError:
    """The refusal of item `key`, whose staged `value` does not pickle for the writer process (raising `exc`)."""
    return unpicklable(
        key,
        value,
        exc,
        doing="pickled for the async writer process",
        op=ForkingPickler.dumps,
        fix="Async saves need every value to pickle (requires_copy=True values are deep-copied, so e.g. a "
        "lambda stays a lambda); make it picklable, or use CheckpointManager.Config.with_sync_save().",
    )


# Every writer process object this process made, started or starting: a child made by os.fork() forgets them.
_WRITER_PROCESSES: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_the_parents_writers() -> None:
    """In a child made by os.fork(): drop the parent's writer processes from the child's multiprocessing children.

    The child inherits multiprocessing's list of the parent's children, and at its exit multiprocessing
    terminates every daemon child on it and joins it: the child's normal exit SIGTERMed the parent's writer (a
    save in flight there was lost; a writer still starting failed the parent's first save) and then failed
    joining a process that is not its own. The fork start method clears that list itself; a plain os.fork() does
    not, and multiprocessing offers no public way to. Writers are known by object, not by pid: one still being
    spawned at the fork has no pid the saver knows yet.
    """
    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.difference_update(set(_WRITER_PROCESSES))


def _forget_the_parents_resource_sharer() -> None:
    """In a child made by os.fork(): a resource sharer of the child's own, as the fork start method gives it.

    A staging slab travels to the writer as a descriptor that multiprocessing's resource sharer hands over on
    request, by key. The child inherits the parent's sharer: the parent's address and key counter, but not its
    thread. A manager built in the child (what the refusal of the parent's manager there advises) sent its slab
    under a key the parent's sharer answered: the parent logged `KeyError` and the child's writer died at every
    save (`WriterProcessDied`), or, where the parent had a send of that key pending, the child's writer mapped
    the parent's slab and the parent's writer lost it. `_afterfork` is what multiprocessing runs for its own
    fork children; a plain os.fork() does not run it, and there is no public way to.
    """
    sharer_module = sys.modules.get("multiprocessing.resource_sharer")
    sharer = getattr(sharer_module, "_resource_sharer", None)
    reset = getattr(sharer, "_afterfork", None)
    if callable(reset):
        reset()


os.register_at_fork(after_in_child=_forget_the_parents_writers)
os.register_at_fork(after_in_child=_forget_the_parents_resource_sharer)


class CheckpointProcess:
    def __init__(
        self,
        storage_config: StorageConfig,
        config: CheckpointProcessConfig | None = None,
        subprocess_init_fn: Callable[..., None] | None = None,
        subprocess_init_args: tuple[Any, ...] = (),
    ) -> None:
        self.config = config or CheckpointProcessConfig()
        self._storage_config = storage_config
        self._init = (subprocess_init_fn or _noop, tuple(subprocess_init_args))
        # Every writer of this process object builds its storage with these, as the manager's own storage was.
        self._environment = store_environment()
        self._environment_said: frozenset[str] = frozenset()  # the changed names a WARNING has told of
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        self._start_error: BaseException | None = None
        self._ready = Flag()  # not an Event: an interrupt in its wait left its lock held, and set() blocked
        self._lock = threading.Lock()
        self._closing = False
        self._starting: Any = None  # the process being spawned, until it is ready
        self._stopping: Any = None  # the process close() is stopping, out of `_proc` (`_kill_left`)
        self._killed_pid: int | None = None  # the writer kill() ended: a request it had not taken is not handed on
        self._start_at_next_save = False  # a start now would fail as the last one did (no working directory)
        self._start_in_background()

    def _start_in_background(self) -> None:
        if self._closing:
            return
        self._slab_generation: int | None = None  # a new process has mapped no slab yet
        self._ready.clear()
        self._start_error = None
        start_thread(threading.Thread(target=self._start, name=f"{self.config.thread_name_prefix}-spawn", daemon=True))

    def _start(self) -> None:
        proc: Any = None
        parent: Connection | None = None
        try:
            _check_working_directory()
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(
                target=_writer_main,
                args=(child, self._storage_config, self._environment, *self._init),
                name=f"{self.config.thread_name_prefix}-writer",
                daemon=True,
            )
            _WRITER_PROCESSES.add(proc)
            _spawn_with_group_signals_blocked(proc)
            self._starting = proc
            if self._closing:  # close() came while we spawned: see _abort_start
                proc.kill()
                proc.join(5)
            child.close()
            if not parent.poll(self.config.subprocess_init_timeout_secs):
                proc.kill()
                raise TimeoutError(
                    f"Checkpoint writer process did not start within {self.config.subprocess_init_timeout_secs}s "
                    f"(CheckpointProcessConfig.subprocess_init_timeout_secs)."
                )
            hello = parent.recv()
            if isinstance(hello, StartFailed):
                proc.join(5)
                raise _WriterSetUpFailed(hello.step, hello.error)
            if not isinstance(hello, Ready):
                raise CheckpointError(f"Checkpoint writer process sent {type(hello).__name__} instead of Ready")
            if self._closing:  # close() gave up on this start (`_end_start`): no writer may outlive it
                proc.kill()
                raise CheckpointError("Checkpoint writer process started after close(); it was stopped")
            self._proc, self._conn = proc, parent
        except BaseException as exc:
            self._start_error = _killed_at_start(proc) if isinstance(exc, EOFError) else None
            self._start_error = self._start_error or exc
            self._starting = None
            _release(proc, parent)
        finally:
            self._starting = None  # a closed process object keeps its pipes open for as long as it is held
            self._ready.set()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def ensure_ready(self) -> None:
        """Start (or restart) the writer now if it is not up: a writer that cannot start fails here, before any
        request is sent, as a `CheckpointError` saying why."""
        with self._lock:
            self.wait_ready()

    def wait_ready(self) -> None:
        if self._start_at_next_save:
            self._start_at_next_save = False
            self._start_in_background()
        if not self._ready.wait(self.config.subprocess_init_timeout_secs + 5):
            raise TimeoutError("Checkpoint writer process did not start in time")
        if self._start_error is not None:
            error, self._start_error = self._start_error, None
            if isinstance(error, _NoWorkingDirectory):  # started now, it fails again before the caller can chdir
                self._start_at_next_save = True
            else:
                self._start_in_background()  # let the next save try again
            if isinstance(error, _WriterKilledAtStart):
                raise CheckpointError(
                    f"Checkpoint writer process was {_how_it_ended(error.exitcode)} while it started (the OOM "
                    f"killer, or whatever else kills it; dmesg says). Nothing was saved; save again (the next save "
                    f"starts a new writer)."
                ) from error
            if isinstance(error, _NoWorkingDirectory):
                raise CheckpointError(
                    "Checkpoint writer process cannot start: the working directory of this process no longer "
                    "exists (it was deleted after the program changed into it), and the writer is spawned there. "
                    "os.chdir() to a directory that exists (the next save starts the writer), or save synchronously "
                    "(CheckpointManager.Config.with_sync_save()). Nothing was saved."
                ) from error
            if isinstance(error, _WriterSetUpFailed) and isinstance(error.error, MemoryError):
                raise MemoryError(  # what a caller that retries with less catches
                    f"Checkpoint writer process failed to start: {error.step} ran out of memory in the writer "
                    f"process: {error.error} Nothing was saved; the next save starts a new writer."
                ) from error.error
            if isinstance(error, _WriterSetUpFailed):
                raise CheckpointError(
                    f"Checkpoint writer process failed to start: {error.step} raised in the writer process: "
                    f"{type(error.error).__name__}: {error.error}. Nothing was saved; fix it and save again (the "
                    f"next save starts a new writer)."
                ) from error.error
            raise CheckpointError(
                f"Checkpoint writer process failed to start: {type(error).__name__}: {error}. The writer is spawned "
                f"and re-imports your main module: guard your script's entry point with "
                f"`if __name__ == '__main__':`, and keep storage configs and subprocess_init_fn importable."
            ) from error
        if self._proc is not None and not self._proc.is_alive():
            logger.warning(
                "The checkpoint writer process %s died since the last save (%s); starting a new one for this save. "
                "If it keeps dying, look for the OOM killer (dmesg) or whatever else kills it.",
                self._proc.pid,
                _how_it_ended(self._proc.exitcode),
            )
            self._drop_dead_writer()
            self._start_in_background()
            self.wait_ready()

    def _drop_dead_writer(self) -> None:
        """(Holding `_lock`, so no write uses its pipe.) A writer that died gives back its pipe and process
        descriptors now, not when the last reference to it goes (a save's error may keep it for the whole run)."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        _release(proc, conn)

    def drop_slab(self) -> None:
        """Have the writer unmap the staging slab it maps, and wait (bounded) until it has: called between saves,
        before the stager allocates a slab of a new layout. A writer that does not answer is left as it is (the
        next write finds out); the new slab then needs room beside the old one, as before."""
        with self._lock:
            conn = self._conn
            if conn is None or self._slab_generation is None:
                return
            try:
                conn.send(DropSlab())
                self._slab_generation = None  # the next write sends the new slab, whatever happens here
                answered = conn.poll(_DROP_SLAB_WAIT_S) and isinstance(conn.recv(), SlabDropped)
            except (EOFError, OSError):
                return  # the writer is gone: it maps nothing; the next write restarts it
            if not answered:  # a late answer is skipped by the next write()
                logger.warning(
                    "The checkpoint writer process did not unmap the old staging slab within %ss; the new one "
                    "needs room beside it",
                    _DROP_SLAB_WAIT_S,
                )

    def write(self, request: WriteRequest | EncodedWrite, slab: tuple[int, Any] | None = None) -> int:
        """Send one request and block until the writer answers; raises the writer's exception.

        `slab` is (generation, shared tensor) of the staging slab the request's SlabRefs point into; it is
        sent (as one shared-memory handle) only when the writer has not seen that generation yet.
        """
        generation = None if slab is None else slab[0]
        encoded = request if isinstance(request, EncodedWrite) else encode_write(request, generation)
        self._say_if_the_environment_changed(encoded.checkpoint_dir)
        with self._lock:
            try:
                reply = self._exchange(encoded, slab)
            except _DiedBeforeTaking as first:
                if first.ended_by_us:
                    raise first.error() from first
                logger.warning(
                    "The checkpoint writer process %s died (%s) before it took the write of %s; nothing of it was "
                    "written. It goes to a new writer. If writers keep dying, look for the OOM killer (dmesg) or "
                    "whatever else kills them.",
                    first.pid,
                    _how_it_ended(first.exitcode),
                    encoded.checkpoint_dir,
                )
                try:
                    reply = self._exchange(_for_a_new_writer(encoded), slab)
                except _DiedBeforeTaking as second:
                    raise second.error() from second
        if isinstance(reply, Failed):
            raise reply.error
        if not isinstance(reply, Written):
            raise CheckpointError(f"Unexpected response from the checkpoint writer process: {type(reply).__name__}")
        return reply.nbytes

    def _say_if_the_environment_changed(self, checkpoint_dir: str) -> None:
        """A WARNING, once per change, naming the store variables (never their values: credentials) that differ
        from those the manager was built with: the save still goes where they said then. Before, nothing told a
        job that its new AWS_* values did not reach its saves."""
        if isinstance(self._storage_config, LocalFileSystemStorageConfig):
            return  # reads no store variable
        now = store_environment()
        changed = frozenset(k for k in now.keys() | self._environment.keys() if now.get(k) != self._environment.get(k))
        if not changed or changed == self._environment_said:
            return
        self._environment_said = changed
        logger.warning(
            "%s changed since this manager was built; the save of %s, like every save and load of this manager, "
            "uses the values it was built with (its writer process gets them too, also when one is spawned "
            "again). Build a new CheckpointManager to use the new values.",
            ", ".join(sorted(changed)),
            checkpoint_dir,
        )

    def _exchange(self, encoded: EncodedWrite, slab: tuple[int, Any] | None) -> Any:
        """(Holding `_lock`.) Send one request to the writer, starting one if none is up, and return its answer.
        Raises `_DiedBeforeTaking` when the writer died before it said `Taken` (nothing was written), and
        `WriterProcessDied` (outcome unknown) when it died after."""
        self.wait_ready()
        if self._conn is None:
            raise WriterProcessDied("The checkpoint writer process is not running; no checkpoint was committed.")
        pid, taken, digest = self.pid, False, None
        try:
            if slab is not None and slab[0] != self._slab_generation:
                self._conn.send(MapSlab(*slab))
                self._slab_generation = slab[0]
            self._conn.send(Incoming(encoded.data.nbytes, sum(buffer.nbytes for buffer in encoded.buffers)))
            _send_buffers(self._conn.fileno(), (encoded.data, *encoded.buffers))
            reply = self._conn.recv()
            while isinstance(reply, (SlabDropped, Taken, Publishing)):  # SlabDropped: late, for a drop_slab()
                taken = taken or isinstance(reply, Taken)
                digest = reply.digest if isinstance(reply, Publishing) else digest
                reply = self._conn.recv()
        except (EOFError, OSError) as exc:
            code = _exit_code(self._proc)
            self._drop_dead_writer()
            self._start_in_background()
            killed = pid is not None and pid == self._killed_pid
            stopped_by: StoppedBy = "close()" if self._closing else "timeout" if killed else None
            if not taken:
                raise _DiedBeforeTaking(pid, code, encoded.checkpoint_dir, stopped_by) from exc
            raise WriterProcessDied(
                _death_message(pid, code, encoded.checkpoint_dir, taken=True, stopped_by=stopped_by),
                outcome_unknown=True,
                manifest_digest=digest,
                pid=pid,
                if_not_committed=_death_message(
                    pid, code, encoded.checkpoint_dir, taken=True, stopped_by=stopped_by, committed=False
                ),
            ) from exc
        return reply

    def _abort_start(self, end: Deadline) -> None:
        """close() before the writer is ready: nothing can be in flight (writes hold the lock close() holds), so
        the spawning child, still importing torch, is killed instead of waited for (seconds on a busy machine).
        Its end is waited for until `end`, a wait close() counts (a fixed 5 s of its own overran its bound)."""
        starting = self._starting
        with contextlib.suppress(ValueError):  # the spawn failed meanwhile, and closed its process object
            if starting is not None and starting.is_alive():
                starting.kill()
                starting.join(_left(end))

    def kill(self, end: Deadline | None = None) -> None:
        """SIGKILL the writer now (it may be stopped or stuck); a write waiting on it fails as WriterProcessDied.
        Its end is waited for until `end` (`KILLED_EXIT_S` from now by default)."""
        proc = self._proc
        if proc is not None and proc.is_alive():
            self._killed_pid = proc.pid
            proc.kill()
            proc.join(_left(end or Deadline(KILLED_EXIT_S)))

    def _end_start(self, wait_s: float) -> bool:
        """(close(), holding `_lock`.) Kill the writer being started and wait `wait_s` for its start to report;
        whether it did. Before, the wait was `subprocess_init_timeout_secs`: a start whose pipe a process forked
        by `subprocess_init_fn` kept open reported only then, and close() overran its bound by that much. One
        that reports later finds `_closing` set and kills the writer it got (`_start`)."""
        end = Deadline(wait_s)
        self._abort_start(end)
        if self._ready.wait(_left(end)):
            return True
        logger.warning(
            "close(): the start of the checkpoint writer process being started did not end within %.0fs "
            "(what is left of CheckpointProcessConfig.subprocess_shutdown_timeout_secs, and %s s more), though "
            "the writer was killed (a process it started, e.g. in subprocess_init_fn, may hold its pipe open); "
            "close() returns without waiting longer.",
            wait_s,
            KILLED_EXIT_S,
        )
        return False

    def shutdown_bound_s(self) -> float:
        """The most `close()` takes: `subprocess_shutdown_timeout_secs`, and where it kills the writer, the
        kernel's end of it (`KILLED_EXIT_S`, twice: the lock a write gives back, then the reap). What a second
        close() waiting for this one allows (it allowed a fixed 10 s, whatever the timeout set)."""
        return float(self.config.subprocess_shutdown_timeout_secs) + 2 * KILLED_EXIT_S

    def close(self) -> None:
        """Stop the writer; every wait is bounded (a stuck or stopped writer is killed). The wait for a write in
        progress, for the writer's answer to Stop and for its exit share `subprocess_shutdown_timeout_secs`
        (each had all of it: a writer that stopped answering was killed at twice the timeout); past it,
        `KILLED_EXIT_S` for the killed writer to end (`shutdown_bound_s`). A manager's close() waits for its last
        write before, so the lock is free here unless the writer was killed meanwhile.

        Interrupted in one of its waits (Ctrl-C), it kills the writer before it raises (`_kill_left`)."""
        try:
            self._close()
        except BaseException:
            self._kill_left()
            raise

    def _kill_left(self) -> None:
        """SIGKILL, without waiting, every writer an interrupted close() had not ended: running, being stopped or
        being started. Before, a Ctrl-C in the wait for the writer's answer to Stop left it running under a
        closed manager, no one left to end it, and a writer that does not answer (stopped, stuck) hung the
        interpreter's exit for good: multiprocessing only SIGTERMs its daemon children there, then joins them."""
        for proc in (self._proc, self._stopping, self._starting):
            with contextlib.suppress(ValueError):  # a process object closed meanwhile: ended and reaped
                if proc is not None and proc.is_alive():
                    proc.kill()

    def _close(self) -> None:
        self._closing = True
        timeout = self.config.subprocess_shutdown_timeout_secs
        deadline = Deadline(timeout)
        if not self._lock.acquire(timeout=timeout):
            killed = Deadline(KILLED_EXIT_S)  # one wait for the kills' effect: each had its own 5 s
            self.kill(killed)  # a write still waits on it: ending the process ends that wait
            self._abort_start(killed)  # or it waits for a restarted writer still being spawned: end that one too
            if not self._lock.acquire(timeout=_left(killed)):
                logger.warning(
                    "close(): %ss (CheckpointProcessConfig.subprocess_shutdown_timeout_secs) and %s s more after "
                    "killing the writer process %s, a save still waits for the checkpoint writer (a write in "
                    "progress, or a writer being started); close() returns without waiting longer. That save is "
                    "not committed and fails; a writer still being spawned is killed once its spawn returns.",
                    self.config.subprocess_shutdown_timeout_secs,
                    KILLED_EXIT_S,
                    None if self._proc is None else self._proc.pid,
                )
                return
        try:
            if not self._ready.is_set() and not self._end_start(_left(deadline) + KILLED_EXIT_S):
                return
            if self._proc is None:
                return
            proc, conn = self._proc, self._conn
            self._stopping = proc
            self._proc = self._conn = None
        finally:
            self._lock.release()
        stopped = False
        try:
            if conn is not None:
                conn.send(Stop())
                stopped = conn.poll(_left(deadline)) and isinstance(conn.recv(), Stopped)
        except (OSError, EOFError) as exc:  # the writer is gone already: the join below reaps it
            logger.debug("Could not send Stop to the writer process: %r", exc)
        if stopped:
            _reap_in_background(proc, timeout)  # off close()'s wait: the kernel tears it down
        else:
            _reap(proc, _left(deadline), timeout)
        self._stopping = None
        if conn is not None:
            conn.close()


# How long a SIGKILLed writer is given to end (the kernel's teardown, a fraction of a second): no wait of the user's
# settings, so close()'s bound states it (`CheckpointProcess.shutdown_bound_s`, docs/operations.md).
KILLED_EXIT_S = 5.0


# Who ended a writer that died under a save, when the engine did: close(), or a save's timeout (kill()).
StoppedBy = Literal["close()", "timeout"] | None


class _DiedBeforeTaking(Exception):
    """(Trainer side.) The writer died before it said `Taken`: it wrote nothing of the request."""

    def __init__(self, pid: int | None, exitcode: int | None, checkpoint_dir: str, stopped_by: StoppedBy) -> None:
        super().__init__(f"writer {pid} died ({_how_it_ended(exitcode)}) before it took the write")
        self.pid, self.exitcode, self.checkpoint_dir = pid, exitcode, checkpoint_dir
        self.stopped_by = stopped_by

    @property
    def ended_by_us(self) -> bool:
        """close() or a timeout's kill(): the request must not go to another writer."""
        return self.stopped_by is not None

    def error(self) -> WriterProcessDied:
        return WriterProcessDied(
            _death_message(self.pid, self.exitcode, self.checkpoint_dir, taken=False, stopped_by=self.stopped_by)
        )


def _death_message(
    pid: int | None,
    exitcode: int | None,
    checkpoint_dir: str,
    *,
    taken: bool,
    stopped_by: StoppedBy,
    committed: bool | None = None,
) -> str:
    """What a save whose writer died is told: which writer, how it ended, what became of the save, and of the
    writer. One sentence for both moments, so that they differ only where the facts do: before the writer
    took the request nothing of it was written; after, it may have committed (`committed` None), or the trainer
    found that it had not (False: it looked at the id, and removed what the save wrote)."""
    how = _how_it_ended(exitcode) + (f", exit code {exitcode}" if exitcode is not None and exitcode < 0 else "")
    if taken and committed is False:
        when = f"during the write of {checkpoint_dir} ({how})"
        save = (
            f", before the checkpoint was in place: {checkpoint_dir} was NOT committed. The trainer removes what the "
            f"save wrote (a WARNING says so if it cannot); an earlier checkpoint at that id is intact. Save again."
        )
    elif taken:
        when = f"during the write of {checkpoint_dir} ({how})"
        save = (
            ". The id holds its previous checkpoint, or this one if the writer died right after committing it; a "
            "load returns one of them whole."
        )
    else:
        when = f"before it took the write of {checkpoint_dir} ({how})"
        save = ": nothing of it was written, and the id holds what it held before."
    return f"Checkpoint writer process {pid} died {when}{save} {_what_became_of_the_writer(stopped_by)}"


def _what_became_of_the_writer(stopped_by: StoppedBy) -> str:
    """Before, a timeout's kill read "stopped by close() or a timeout", naming neither which nor the setting."""
    if stopped_by == "close()":
        return "It was stopped by close()."
    if stopped_by == "timeout":
        return "It was killed when a wait for the save timed out (save.wait_timeout_secs)."
    return "It is restarted for the next save."


class _NoWorkingDirectory(Exception):
    """(Trainer side.) The working directory is gone, and a spawned process starts in it."""


def _check_working_directory() -> None:
    """multiprocessing's spawn reads os.getcwd() for the child: a deleted one failed the start with a bare
    FileNotFoundError, which read as an import problem of the user's."""
    try:
        os.getcwd()
    except FileNotFoundError as exc:
        raise _NoWorkingDirectory(str(exc)) from None


class _WriterSetUpFailed(Exception):
    """(Trainer side.) What `StartFailed` reported, kept until a save asks for the writer."""

    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(f"{step}: {type(error).__name__}: {error}")
        self.step = step
        self.error = error


def _release(proc: Any, conn: Connection | None) -> None:
    """A writer that failed to start, or died, gives back its descriptors now, not when the error that names it
    is collected (its traceback holds them, and a save's Future holds the error)."""
    if conn is not None:
        conn.close()
    if proc is not None and proc.pid is not None:
        proc.join(5)
        with contextlib.suppress(ValueError):  # still running after 5 s: its pipes stay until it is reaped
            proc.close()


class _WriterKilledAtStart(Exception):
    """(Trainer side.) The writer died of a signal before it said Ready: no import problem of the user's."""

    def __init__(self, exitcode: int) -> None:
        super().__init__(f"killed by signal {-exitcode} while starting")
        self.exitcode = exitcode


def _killed_at_start(proc: Any) -> _WriterKilledAtStart | None:
    """Before: a writer SIGKILLed while it imported torch read as "failed to start: EOFError", with advice to
    guard the script's entry point, which was not the fix."""
    if proc is None:
        return None
    with contextlib.suppress(Exception):
        proc.join(5)
        if proc.exitcode is not None and proc.exitcode < 0:
            return _WriterKilledAtStart(proc.exitcode)
    return None


def _how_it_ended(exitcode: int | None) -> str:
    """A process's exit code in words: multiprocessing gives -N for death by signal N."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _exit_code(proc: Any) -> int | None:
    """A dead writer's exit code (a negative signal number), once the kernel has it: the pipe breaks a moment
    before the process can be reaped."""
    if proc is None:
        return None
    proc.join(1.0)
    return proc.exitcode  # type: ignore[no-any-return]


def _left(deadline: Deadline) -> float:
    """What is left of a deadline made from a number of seconds (never None)."""
    return deadline.left() or 0.0


def _reap(proc: Any, timeout_s: float, said_s: float | None = None) -> None:
    """Wait for the writer to exit (kill it past `timeout_s`), so that no zombie is left. `said_s`: the timeout
    the WARNING names, where `timeout_s` is what is left of it."""
    proc.join(timeout_s)
    if proc.exitcode is None and not multiprocessing.connection.wait([proc.sentinel], 0):  # not exited
        shown = timeout_s if said_s is None else said_s
        logger.warning("The checkpoint writer process %s did not exit within %ss; killing it", proc.pid, shown)
        proc.kill()
        proc.join(KILLED_EXIT_S)


def _reap_in_background(proc: Any, timeout_s: float) -> None:
    """Reap a writer that answered Stop on a daemon thread instead of in close().

    `Stopped` means every write was answered (committed and fsynced, or failed); what remains is the kernel
    tearing down the writer's address space, slab mapping included, which took a tenth of a second per GiB
    staged. An interpreter exiting first still joins it (multiprocessing's exit handler).
    """
    start_thread(threading.Thread(target=_reap, args=(proc, timeout_s), name="ckpt-writer-reap", daemon=True))
