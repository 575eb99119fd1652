"""`CheckpointManager`: the one object user code talks to."""

from __future__ import annotations

import atexit
import dataclasses
import enum
import errno
import functools
import logging
import math
import os
import posixpath
import re
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from torch_checkpointing.agreement import GroupTransport, agree, agree_outcome
from torch_checkpointing.checkpoint_layout import ReplicatedLayoutInfo, default_layout_info
from torch_checkpointing.checkpoint_loader import CheckedLoad, CheckpointLoader, interrupted_note
from torch_checkpointing.checkpoint_saver import (
    AsyncCheckpointSaver,
    CheckpointSaver,
    SavePlan,
    SyncCheckpointSaver,
    WriteFuture,
    refuse_interrupted_write,
)
from torch_checkpointing.checkpoint_writer import explained_disk_fault
from torch_checkpointing.commit import (
    INCOMPLETE_MARKER,
    MANIFEST_FILE_NAME,
    METADATA_FILE_NAME,
    MadeDirectory,
    check_target,
    make_parents,
    remove_made,
    temporary_name,
)
from torch_checkpointing.config import (
    DEFAULT_WAIT_TIMEOUT_SECS,
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    CheckpointSaverConfig,
    SyncCheckpointSaverConfig,
    check_instance,
    integer_as_int,
    literal_tilde,
    real_as_number,
    recheck,
    refuse_unencodable,
    snapshot,
)
from torch_checkpointing.discovery import OwnerLock, expands_home, self_describing_layouts
from torch_checkpointing.errors import (
    CheckpointError,
    CommitError,
    ConfigError,
    ConfigTypeError,
    log_safely,
    resource_shortage_named,
)
from torch_checkpointing.manifest import shown_name
from torch_checkpointing.metadata_manager import DefaultMetadataManager
from torch_checkpointing.names import NAME_MAX, PATH_MAX
from torch_checkpointing.pickling import callback_unpicklable
from torch_checkpointing.rank_context import RankContext, current_rank_info
from torch_checkpointing.retention import RetentionPolicy, RetentionRunner
from torch_checkpointing.safe_load_check import SafeLoadCheck
from torch_checkpointing.schema import (
    ItemSpec,
    ResolvedItem,
    check_layout,
    check_names_fit,
    resolve,
    validate_keys,
)
from torch_checkpointing.signals import Held, signals_deferred, start_thread
from torch_checkpointing.storage import LOCAL_SCHEMES, fsspec_storage_for, local_path_of
from torch_checkpointing.storage.base_storage import Storage, StorageConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig
from torch_checkpointing.store_channel import StoreAddress
from torch_checkpointing.traversal import dotted_key, is_dtensor, iter_leaves
from torch_checkpointing.types import RankInfo
from torch_checkpointing.waiting import Deadline, Flag, Wakeups

__all__ = ["CheckpointManager"]


logger = logging.getLogger("torch_checkpointing.manager")
# What a close() waiting for another thread's allows past that one's waits (save.wait_timeout_secs, then the
# saver's `close_bound_s`) for its last steps, which wait on nothing: releasing the loader, the owner lock and the
# process group. Without it, a second close() that began a moment after the first gave up a moment before it.
_RELEASE_S = 1.0

# A collective load's copy holds a signal until every rank has said whether its own copy finished: before, one
# landing in this rank's copy was raised before it answered, and the others raised that it failed, though every
# rank's templates held the checkpoint whole.
_RESTORE_HELD = Held(
    "the copy into the templates and the ranks' word on it",
    "every rank has said whether its copy finished (at most the process group's timeout)",
    "the templates may be partly restored, and the other ranks wait the process group's timeout",
    again=(
        "sent again, it is acted on at once during the copy, but while this rank waits in the ranks' gather only "
        "when that wait returns (no Python handler runs inside gloo's wait): when the other ranks answer or the "
        "process group's timeout ends"
    ),
)
# A save's two agreed steps over the gloo group; the second is named with the id (the plan's may differ by rank)
_PLAN_STEP = "Checkpoint save: the plan"
_TARGET = "checking the target and building the metadata"
_TARGET_STEP = f"Checkpoint save: {_TARGET}"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


_C = TypeVar("_C")


class _Preset(classmethod):  # type: ignore[type-arg]
    """`Config.with_sync_save` / `with_async_save`: a classmethod, as API_SURFACE §5 has it (on the class,
    `Config(save=...)`, every other field default), that called on a config gives that config with its saver
    replaced (a new object; the fields shared, not copied): a plain classmethod ignored the config it was called
    on, and `Config(items=...).with_sync_save()` dropped the items, layouts and retention set there, silently.
    Bound as a method either way, so a preset pickles and compares as the classmethod did."""

    def __get__(self, config: _C | None, owner: type[_C] | None = None) -> Callable[[], _C]:
        if config is None:
            bound: Callable[[], _C] = super().__get__(config, owner)
            return bound
        return types.MethodType(self.__func__, config)


def _with_saver(on: Any, saver: CheckpointSaverConfig) -> Any:
    """`on` (a Config class, or a config) made into a config whose saver is `saver`."""
    return on(save=saver) if isinstance(on, type) else dataclasses.replace(on, save=saver)


class CheckpointManager:
    """Saves and loads checkpoints made of top-level items, each shaped by its `ItemSpec`.

    Construct one per training job on every rank (in a multi-rank job, construction, `save()` and `close()`
    are collective). Async managers start their writer process at construction.

    The config after construction: `manager.config` is the object passed in (not a copy), and it stays
    mutable, so the manager checks it again at every `save()`, `load()` and `prewarm_staging()`:

    * `items`, `default`, `pre_finalize_callback` and `finalize_callback` are read at each call: a change
      applies from the next call, checked as at construction (a non-ItemSpec or a bad key is a
      ConfigTypeError/ConfigError naming it).
    * Every other field (`save` and everything in it, `load`, `storage_config`, `subprocess_init_fn`/`_args`,
      `retention`) built the saver, the writer process, the loader and the timeouts at construction; a change
      (a field set, or the object replaced) is refused by the next call with a ConfigError naming the field.
      Build a new CheckpointManager for a new setting. The saver, the writer process, the loader, the storage
      and `close()` read copies of `save`, `load` and `storage_config` (their dicts and lists too) taken at
      construction, so such a change never reaches them, not even half-way (a timeout edited before `close()`
      is not the one it waits by; a `storage_options` entry edited in place, which is not refused, never
      reaches a writer restarted after a crash).

    A config edited between its construction and the manager's is checked again when the manager is built (and a
    storage config when `create_storage()` builds from it): a bad value is the ConfigError/ConfigTypeError naming
    the field that its construction would have raised.

    What is compared is a snapshot of the values of those fields, taken at construction: the configuration
    dataclasses are walked field by field and plain values (numbers, strings, flags, tuples, dicts) copied;
    any other object (a resharder, a callback, a storage config's client or credentials object) is neither
    copied nor compared by value, only by identity, and stays the caller's, shared with the manager.
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        """What a `CheckpointManager` saves and loads, and how; see the class docstring for which fields may
        change after construction (items, default, the finalize callbacks) and which are refused."""

        items: Mapping[str, ItemSpec] = field(default_factory=dict)
        default: ItemSpec | None = field(default_factory=ItemSpec)
        save: CheckpointSaverConfig = field(default_factory=AsyncCheckpointSaverConfig)
        load: CheckpointLoaderConfig = field(default_factory=CheckpointLoaderConfig)
        # None: the local filesystem, unless the first id names a store (s3://...; docs/storage.md).
        storage_config: StorageConfig | None = None
        subprocess_init_fn: Callable[..., None] | None = None
        subprocess_init_args: tuple[Any, ...] = ()
        pre_finalize_callback: Callable[[str, Any], None] | None = None
        finalize_callback: Callable[[str, Any], None] | None = None
        # Which committed checkpoints to keep; applied by rank 0 after each commit (torch_checkpointing.retention).
        retention: RetentionPolicy | None = None

        def build(self) -> CheckpointManager:
            """`CheckpointManager(self)`."""
            return CheckpointManager(self)

        @_Preset
        def with_sync_save(on: Any) -> CheckpointManager.Config:
            """A config whose saves are synchronous (`save=SyncCheckpointSaverConfig()`): on the class, every other
            field default; on a config, that config's other fields."""
            made: CheckpointManager.Config = _with_saver(on, SyncCheckpointSaverConfig())
            return made

        @_Preset
        def with_async_save(on: Any) -> CheckpointManager.Config:
            """A config whose saves are asynchronous (`save=AsyncCheckpointSaverConfig()`, the default anyway): on
            the class, every other field default; on a config, that config's other fields."""
            made: CheckpointManager.Config = _with_saver(on, AsyncCheckpointSaverConfig())
            return made

    def __init__(self, config: Config | None = None) -> None:
        self._closed = True  # until construction succeeds, so close() does nothing
        self._closer: int | None = None  # the thread whose close() is under way: a second close() waits for it
        self._close_ended = Flag()
        self._pid = os.getpid()  # a child made by os.fork() has a copy of this manager, not its writer
        # Which threads are inside save()/load()/prewarm_staging() now: close() from another thread waits for them.
        # Each call registered by its token -> thread ident, one store in, one pop out (`_enter_call`); `_calls`
        # guards it, a C-level lock (not a Condition: see `waiting`), and `_call_ended` wakes close().
        self._calls = threading.RLock()
        self._call_ended = Wakeups()
        self._running: dict[object, int] = {}
        config = config if config is not None else CheckpointManager.Config()
        if not isinstance(config, CheckpointManager.Config):
            raise ConfigTypeError(_not_a_config(config))
        self._validate(config)
        for name in _FIXED_CONFIGS:  # edits since each was built (the items are checked at every call)
            recheck(getattr(config, name))
        _warn_refused_layouts(config, current_rank_info().global_world_size)
        self.config = config
        self._fixed = _fixed_fields(config)  # what a later change is refused against (`_recheck_config`)
        # What the saver, writer, loader and close() read: copies, which no edit of `config` reaches.
        self._save_config = snapshot(config.save)
        self._load_config = snapshot(config.load)
        # The storage and the writer process are built from a copy too: an edit of `storage_options` (not refused,
        # see `_fixed_fields`) reached a writer restarted after a crash, while the trainer kept the first.
        storage_config = snapshot(config.storage_config or LocalFileSystemStorageConfig())
        storage = storage_config.create_storage()
        timeout = self._save_config.wait_timeout_secs
        self._ctx = RankContext(float(timeout if timeout is not None else DEFAULT_WAIT_TIMEOUT_SECS))
        self._seq = 0
        # One save() at a time from this process's threads: a save's plan (temporary name, first-save metadata)
        # and its wait for the previous write come before it stages into the shared slab (API_SURFACE §10).
        self._saving = threading.Lock()
        # The thread inside `_saving` and the id it saves: a save() that thread makes meanwhile (from the save's
        # pre_finalize_callback/finalize_callback, or a signal handler's emergency save) would wait for itself.
        self._saving_on: tuple[int, str] | None = None
        self._safe_load = SafeLoadCheck()
        self._shared_said: set[str] = set()  # {rank}-less items warned about, or declared replicated
        self._metrics_said = False  # rank-local metrics= warned about (once per manager)
        self._metadata = DefaultMetadataManager() if _wants_metadata(config) else None
        # Without a storage config, the first id picks the storage (a path: local; s3://...: that store), once.
        self._first_id: tuple[str | None, str] | None = None  # (scheme, id); None scheme = local filesystem
        self._owner = OwnerLock(self._ctx.uid)  # lets `gc` tell this job's live temporaries from dead ones
        try:
            self._attach_storage(storage_config, storage)
        except BaseException:  # a refused construction keeps nothing: no descriptor, no process group
            self._owner.release()
            self._ctx.close()
            raise
        self._closed = False

    def _attach_storage(self, storage_config: StorageConfig, storage: Storage) -> None:
        """Build what holds the storage: the saver (an async one starts its writer process), loader, retention."""
        config, save = self.config, self._save_config
        self._storage = storage
        self._saver: CheckpointSaver
        if isinstance(save, SyncCheckpointSaverConfig):
            self._saver = SyncCheckpointSaver(storage, save.writer_config)
        elif isinstance(save, AsyncCheckpointSaverConfig):
            self._saver = AsyncCheckpointSaver(
                save, storage_config, config.subprocess_init_fn, config.subprocess_init_args, storage=storage
            )
        else:  # not reached: `_validate` refuses any other type
            raise ConfigTypeError(_unsupported_saver(save))
        self._loader = CheckpointLoader(storage, self._load_config, self._ctx.rank_info)
        self._retention = RetentionRunner(config.retention, self._ctx.rank, storage) if config.retention else None
        # A save still in flight at interpreter exit gets its bounded wait (and the writer its stop) even when
        # the script never calls close() or drops the manager; registered per manager, unregistered by close().
        self._exit_hook = functools.partial(_close_at_exit, self._saver, save.wait_timeout_secs, self._pid)
        atexit.register(self._exit_hook)
        # A manager dropped without close() gives its writer, threads, slab and descriptors back once collected,
        # not only at interpreter exit (a loop building a manager per call kept a writer process per call).
        parts = _Parts(
            self._pid,
            self._exit_hook,
            self._saver,
            save.wait_timeout_secs,
            self._loader,
            self._retention,
            self._owner,
            self._ctx,
        )
        self._dropped = weakref.finalize(self, _close_dropped, parts)
        self._dropped.atexit = False  # at exit, the exit hook does it

    def _detach_storage(self, deadline: Deadline | None = None) -> None:
        """`deadline`: close()'s, which the retention passes still running share (None: their own 600 s). Each
        part is closed whatever the one before raised: a Ctrl-C while the retention passes were waited for left the
        writer process running, under a manager marked closed."""
        self._dropped.detach()
        atexit.unregister(self._exit_hook)
        try:
            if self._retention is not None:
                self._retention.close(self._bounded(deadline), said=self._timeout_said())
        finally:
            try:
                self._saver.close()
            finally:
                self._loader.close()

    def _recheck_config(self) -> None:
        """At each call: `config` may have been changed since construction (the class docstring's contract)."""
        config = self.config
        self._validate(config)
        changed = _changed_fields(self._fixed, _fixed_fields(config))
        if changed:
            raise ConfigError(
                f"CheckpointManager.Config.{changed[0]} was changed after this manager was built (fields changed: "
                f"{', '.join(changed)}); it is read at construction only (the saver, the writer process, the "
                f"loader and the timeouts were built from it), so the change would not apply, or apply only in "
                f"part. Set it back, or close() this manager and build a new CheckpointManager with the new "
                f"config. Only items, default, pre_finalize_callback and finalize_callback may change between "
                f"calls."
            )
        if self._metadata is None and _wants_metadata(config):  # a resharder item added since
            self._metadata = DefaultMetadataManager()

    @staticmethod
    def _validate(config: Config) -> None:
        """Every field, at construction: a wrong one failed later, at the first load or inside the writer."""
        if not isinstance(config.items, Mapping):
            raise ConfigTypeError(
                f"Config.items must be a Mapping of key -> ItemSpec, got {type(config.items).__name__}"
            )
        validate_keys(list(config.items))
        for key, spec in config.items.items():
            if not isinstance(spec, ItemSpec):
                raise ConfigTypeError(f"Config.items['{key}'] must be an ItemSpec, got {type(spec).__name__}")
        if not isinstance(config.save, (SyncCheckpointSaverConfig, AsyncCheckpointSaverConfig)):
            raise ConfigTypeError(_unsupported_saver(config.save))
        if config.default is not None and not isinstance(config.default, ItemSpec):
            raise ConfigTypeError(f"Config.default must be an ItemSpec or None, got {type(config.default).__name__}")
        _validate_parts(config)

    # ---------------------------------------------------------------- public API

    @property
    def rank_info(self) -> RankInfo:
        """This process's rank and world size, as the manager saw them when it was built."""
        return self._ctx.rank_info

    @property
    def writer_pid(self) -> int | None:
        """The async writer process's pid, for monitoring it (memory, CPU, affinity) like any other process.

        None with sync saves, and while the writer is starting. A writer that dies is replaced, so read this
        again rather than keep it.
        """
        return self._saver.process.pid if isinstance(self._saver, AsyncCheckpointSaver) else None

    def save(
        self,
        checkpoint_id: str,
        checkpoint: Mapping[str, Any],
        *,
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> Future[Any] | None:
        """Sync: returns None once the checkpoint is committed and durable. Async: returns the write Future.

        `step` (default: a trailing integer of the id, e.g. `step_100` -> 100) and `metrics` are recorded in the
        manifest, with the commit time, for tools that pick the latest or best checkpoint.
        """
        call = object()  # see `_enter_call`
        try:
            self._enter_call("save", call)
            started = time.monotonic()
            path = self._checkpoint_path(checkpoint_id)
            _check_saveable_name(path)
            if self._storage.local_path(Path(path)) is not None:
                _check_components_fit(path)
            step = _step_of(path) if step is None else _checked_step(step)
            checked_metrics = _checked_metrics(metrics)
            self._refuse_nested_save(path)
            with self._saving:  # another thread's save() waited for here is part of this one's blocked time
                self._saving_on = (threading.get_ident(), path)
                try:
                    plan = self._plan(_SaveRequest(path, checkpoint, step, checked_metrics, started))
                    write = self._saved_or_undone(plan)
                    if self._retention is not None:
                        self._retention.after_commit(path, write.mirror() if isinstance(write, WriteFuture) else write)
                finally:
                    self._saving_on = None
            return write
        finally:
            self._call_left(self._running.pop(call, None))

    def _saved_or_undone(self, plan: SavePlan) -> Future[Any] | None:
        """The saver's save of `plan`; if it raises, the parent directories the plan made for the id go too."""
        try:
            return self._saver.save(plan)
        except BaseException:
            remove_made(plan.made)
            raise

    def _refuse_process_local(self, checkpoint_id: str) -> None:
        """On several ranks, refuse an id in a store that lives in one process alone (`memory://`): each rank wrote
        its files into its own, and the save failed at the commit blaming "a node-local disk" (or, async, the
        writer process), after every rank had written. In the plan's agreed step, so every rank refuses it."""
        if self._ctx.world_size > 1 and self._storage.process_local(Path(checkpoint_id)):
            raise ConfigError(
                f"Cannot save {checkpoint_id} on {self._ctx.world_size} ranks: memory:// lives in the memory of one "
                f"process, and each rank would write its files into its own memory://, which the other ranks (and "
                f"rank 0's commit) never see. Nothing was written. Use a store every rank reaches: a shared "
                f"directory, file:// on a shared filesystem, or s3://."
            )

    def _refuse_process_local_load(self, checkpoint_id: str) -> None:
        """On several ranks, refuse a collective load of an id in a store that lives in one process alone
        (`memory://`), as its save is refused: each rank read its own memory://, so the ranks failed each with
        another error (one "does not exist", one whatever its own copy lacked), or agreed on copies no save made
        together. In the load's checked step, so every rank raises the same refusal and nothing is restored."""
        if self._ctx.world_size > 1 and self._storage.process_local(Path(checkpoint_id)):
            raise ConfigError(
                f"Cannot load {checkpoint_id} collectively on {self._ctx.world_size} ranks: memory:// lives in the "
                f"memory of one process, and each rank would read its own memory://, which holds only what that "
                f"process put there (a checkpoint saved on several ranks never lands there). Nothing was restored. "
                f"Load from a store every rank reaches (a shared directory, file:// on a shared filesystem, or "
                f"s3://), or, where each process filled its own memory://, load on each rank alone with "
                f"CheckpointLoaderConfig(collective=False)."
            )

    def _refuse_nested_save(self, path: str) -> None:
        """Refuse a save() made by the thread that is inside another save() of this manager: from that save's
        `pre_finalize_callback`/`finalize_callback`, or from a signal handler (a preemption handler's emergency
        save) that ran during it. It waited for the outer save, which waited for it: the process hung for good."""
        held = self._saving_on
        if held is None or held[0] != threading.get_ident():
            return
        raise CheckpointError(
            f"Cannot save {path} from inside the save of {held[1]} on the same thread (a pre_finalize_callback or "
            f"finalize_callback, or a signal handler that ran during that save): saves of one manager run one at "
            f"a time, so this one would wait for ever for the save it is part of. Nothing was written for {path}. "
            f"Save it after that save() has returned (e.g. note the id in the callback and save it next)."
        )

    def load(
        self,
        checkpoint_id: str,
        into: Mapping[str, Any] | None = None,
        *,
        map_location: Any = None,
        strict: bool = False,
    ) -> Mapping[str, Any]:
        """Restore into `into`'s templates (tensors filled in place) and return the loaded mapping.

        On several ranks a load is collective, like a save: every rank checks what it will read (phase 1), the
        ranks agree, and only then does any rank copy (phase 2). If any rank's check failed, or the ranks asked
        for different ids, every rank raises and no rank changed anything, so a job that falls back to an
        earlier checkpoint falls back on every rank together. `CheckpointLoaderConfig(collective=False)` loads on
        this rank alone (for a load that only some ranks run).
        """
        # No signal handler runs before the `try` (building a list and binding names call nothing), so an interrupt
        # anywhere after the function's entry is noted; `call` is made inside it (see `_enter_call`).
        checked: list[CheckedLoad] = []  # the load's checked phase, once it passed (what an interrupt tells)
        call: object = None
        try:
            call = object()
            self._enter_call("load", call)
            with resource_shortage_named(checkpoint_id, "the load"):
                return self._load(checkpoint_id, into, map_location=map_location, strict=strict, checked=checked)
        except BaseException as exc:
            interrupted_note(exc, checkpoint_id, checked)
            raise
        finally:
            self._call_left(self._running.pop(call, None))

    def _load(
        self,
        checkpoint_id: str,
        into: Mapping[str, Any] | None,
        *,
        map_location: Any,
        strict: bool,
        checked: list[CheckedLoad],
    ) -> Mapping[str, Any]:
        if not self._load_config.collective:  # this rank alone (CheckpointLoaderConfig.collective)
            with self._check_load(checkpoint_id, into, map_location=map_location, strict=strict) as alone:
                checked.append(alone)
                return alone.restore()
        what = f"Checkpoint load of {checkpoint_id}"
        checking = f"{what}: checking"
        unchecked = f"{what}: running custom resharders (every rank put its templates back; nothing was restored)"
        restoring = f"{what}: restoring (ranks that did not fail have already filled their templates)"
        transport = self._ctx.transport.for_steps(checking, unchecked, restoring)
        try:
            return self._load_together(
                checkpoint_id,
                into,
                transport,
                (checking, unchecked, restoring),
                map_location=map_location,
                strict=strict,
                checked_load=checked,
            )
        except BaseException as exc:  # a rank that leaves between two steps answers the next (`leave`)
            transport.leave(exc)
            raise

    def _load_together(
        self,
        checkpoint_id: str,
        into: Mapping[str, Any] | None,
        transport: GroupTransport,
        steps: tuple[str, str, str],
        *,
        map_location: Any,
        strict: bool,
        checked_load: list[CheckedLoad],
    ) -> Mapping[str, Any]:
        """The collective load's agreed `steps`: checking, custom resharders, restoring (`checked_load` gets the
        checked phase once this rank's passed)."""
        checking, unchecked, restoring = steps
        given = _comparable_id(checkpoint_id, self._expands_home())
        checked, found = agree_outcome(
            checking,
            transport,
            lambda: self._check_collective_load(checkpoint_id, into, map_location=map_location, strict=strict),
            shared=[given, None],
            discard=CheckedLoad.close,
            shared_of=lambda load: [given, load.commit_token],
        )
        checked_load.append(checked)
        with checked:
            what = f"Checkpoint load of {checkpoint_id}"
            _refuse_different_checkpoints(what, [i for i, _ in found], [c for _, c in found])
            # What the check could not check (a custom resharder's own load) runs first on every rank, and is
            # agreed on before the engine copies anything: a rank whose resharder fails leaves every rank's
            # templates as they were (each rank puts back what its own resharders wrote).
            try:
                agree_outcome(unchecked, transport, checked.restore_unchecked)
            except BaseException:
                checked.undo_unchecked()  # another rank's resharder failed: this rank's templates go back too
                raise
            # The copy and the ranks' word on it, as one hold; on one rank, the copy's own.
            together = signals_deferred(what, held=_RESTORE_HELD) if transport.world_size > 1 else nullcontext()
            with together:
                return agree_outcome(restoring, transport, checked.restore)[0]

    def _check_collective_load(
        self, checkpoint_id: str, into: Mapping[str, Any] | None, *, map_location: Any, strict: bool
    ) -> CheckedLoad:
        """`_check_load` of a load every rank makes together: what one rank alone may load is refused here."""
        self._refuse_process_local_load(self._checkpoint_path(checkpoint_id))
        return self._check_load(checkpoint_id, into, map_location=map_location, strict=strict)

    def _check_load(
        self, checkpoint_id: str, into: Mapping[str, Any] | None, *, map_location: Any, strict: bool
    ) -> CheckedLoad:
        self._recheck_config()  # in the checked step: a config changed on one rank is refused on every rank
        checkpoint_id = self._checkpoint_path(checkpoint_id)
        self._saver.wait_for_write_of(checkpoint_id)
        listed: list[str] | None = None
        if into is None and not self.config.items:
            # Self-describing: every item, read with the layout and (safe) format its manifest records.
            layouts = self_describing_layouts(self._storage, str(checkpoint_id), self._ctx.rank, self._ctx.world_size)
            items = [ResolvedItem(k, None, ItemSpec(layout=lay), lay, False) for k, lay in layouts.items()]
            listed = list(layouts)  # the pinned manifest must list the same (a replace between the two reads)
        else:
            into = dict.fromkeys(self.config.items) if into is None else into
            items = resolve(into, self.config.items, self.config.default, self._ctx.rank)
        with resource_shortage_named(checkpoint_id, "the load's check"):  # in the agreed step: every rank is told
            return self._loader.check(
                str(checkpoint_id), items, map_location=map_location, strict=strict, listed=listed
            )

    def prewarm_staging(self, checkpoint: Mapping[str, Any]) -> None:
        """Allocate (and fill) the async staging buffers ahead of the first save."""
        call = object()  # see `_enter_call`
        try:
            self._enter_call("prewarm staging", call)
            self._recheck_config()
            if isinstance(self._saver, AsyncCheckpointSaver):
                items = resolve(checkpoint, self.config.items, self.config.default, self._ctx.rank)
                self._saver.prewarm(items)
        finally:
            self._call_left(self._running.pop(call, None))

    def lock(self) -> AbstractContextManager[Any]:
        """Hold around in-place updates (optimizer.step()): waits only while a save's staging copy runs."""
        self._check_open("lock")
        if isinstance(self._saver, AsyncCheckpointSaver):
            return self._saver.lock()
        return nullcontext()

    def close(self) -> None:
        """Wait for save()/load() calls running on other threads and for the last write, then stop the writer.

        The waits (for other threads' calls, the last write, the retention passes) are bounded by
        `save.wait_timeout_secs` together, not each: past it the writer is killed and this raises saying the
        save was not committed (or, where the killed writer had put the checkpoint in place and the save's Future
        succeeded, logs a WARNING saying it is committed, and returns). A failed last save is raised here unless
        its Future already reported it. Interrupted while it waits for other threads' calls, it leaves the manager
        open (call close() again). Called while another thread's close() is under way, it waits for that one, and
        closes the manager itself where that one was interrupted.
        In a child made by os.fork() this only marks the copy closed: the writer process is the parent's.
        """
        if os.getpid() != self._pid:  # before taking `_calls`: a parent's thread may have held it at the fork
            self._closed = True
            atexit.unregister(self._exit_hook)
            return
        closing = False
        deadline = Deadline(self._save_config.wait_timeout_secs)  # one for every wait of close(), not one each
        try:
            while not closing:
                with self._calls:
                    if self._closed:
                        closer = self._closer
                    else:
                        self._closed = closing = True  # refuses new calls from here on; one line: no interrupt
                        self._closer = threading.get_ident()
                        self._close_ended.clear()
                if closing:
                    break
                self._await_close_by(closer, deadline)
                if self._closed:  # closed, or still closing past what that close() can take (said there)
                    return
                # that close() was interrupted and left the manager open: this one closes it (it returned over
                # a manager still open, its writer running)
            self._wait_for_running_calls(deadline)
        except BaseException:  # Ctrl-C while waiting: nothing is closed yet, so the manager stays usable
            if closing:
                self._closed = False
                self._end_close()
            raise
        atexit.unregister(self._exit_hook)
        try:
            self._saver.wait(deadline.left())
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._say_close_interrupted(exc)
            raise
        finally:
            try:
                self._owner.release()
                self._detach_storage(deadline)
            finally:
                try:  # a Ctrl-C or a failure in the parts above kept the process group and store until exit
                    self._ctx.close()
                finally:
                    self._end_close()

    def _say_close_interrupted(self, exc: BaseException) -> None:
        """An interrupt (Ctrl-C, a handler's SystemExit) in close()'s wait for the last save: the writer's shutdown
        that follows still lets the write in progress commit or be discarded first, up to its own timeout, and a
        Ctrl-C seemed ignored for all of it (an hour where the timeout is), with no word on how to cut it short."""
        in_flight = self._saver.write_in_flight()
        if in_flight is None:
            return
        logger.warning(
            "close() was interrupted (%s) while the async save of %s was still being written. It now stops the "
            "writer process, first waiting up to %.0f s (CheckpointProcessConfig.subprocess_shutdown_timeout_secs, "
            "then killing a stuck writer) for that write to commit or be discarded; interrupt again to kill the "
            "writer at once (that save is then not committed).",
            type(exc).__name__,
            in_flight,
            self._saver.close_bound_s(),
        )

    def _end_close(self) -> None:
        self._closer = None
        self._close_ended.set()

    def _await_close_by(self, closer: int | None, deadline: Deadline) -> None:
        """A close() while another thread's close() is under way waits for it: it returned at once, with the last
        write still going, and a script whose first close() ran on a daemon thread ended there, losing that
        checkpoint in silence. Not inside the close() under way (a signal handler's), nor in a save Future's
        done-callback (the close() under way waits for the writes queued behind it): either would wait for
        itself."""
        if closer is None or closer == threading.get_ident() or self._saver.on_callback_thread():
            return
        left = deadline.left()  # what that close() can still take: its waits, then the saver's (`close_bound_s`)
        if self._close_ended.wait(None if left is None else left + self._saver.close_bound_s() + _RELEASE_S):
            return
        logger.warning(
            "close(): another thread's close() of this manager was still running after %s and the writer's "
            "shutdown (%.0f s more: subprocess_shutdown_timeout_secs, and killing a stuck writer); returning "
            "without it, so its last save may not be committed yet.",
            self._timeout_said(),
            self._saver.close_bound_s(),
        )

    def __enter__(self) -> CheckpointManager:
        """The manager itself; a closed one is refused, as every other call is: its block ran, then closed nothing
        (a forked child's copy may enter: its `close()` only marks the copy closed)."""
        if self._closed:
            self._check_open("enter a with block")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _check_open(self, what: str) -> None:
        if self._closed:
            # RuntimeError (misuse of a closed object), the type recorded in API_SURFACE §2.3
            raise RuntimeError(
                f"Cannot {what} with a closed CheckpointManager: close() was called on it (or its `with` block "
                f"ended). Build a new CheckpointManager to save or load again."
            )
        self._check_not_forked(what)

    def _check_not_forked(self, what: str) -> None:
        if os.getpid() != self._pid:
            raise CheckpointError(
                f"Cannot {what} with this CheckpointManager in process {os.getpid()}: it was built in process "
                f"{self._pid}, and this is a child made by os.fork(). Its writer process, pipe and locks are the "
                f"parent's, shared with it, so nothing was done in the child. Build a new CheckpointManager in the "
                f"child, or start child processes with the 'spawn' method."
            )

    def _enter_call(self, what: str, call: object) -> None:
        """Register a public call, which close() from another thread waits for instead of stopping the writer
        under it.

        Called first inside the `try` whose `finally` forgets the call, in its first statement, by one pop
        (`self._running.pop(call, None)`): a Ctrl-C lands only where CPython runs a signal handler (a function's
        entry, a C call's return), so it lands before the one store here or after the pop, never between a
        registration and a `try` that would forget it. A context manager could not do this: its `__exit__`'s entry
        is such a place, and a call it skipped stayed registered, so that close() waited for it until
        `save.wait_timeout_secs`. (`load()` makes `call` inside that `try` too, its `except` noting an interrupt
        in `object()`: a `call` still None was never registered.)
        """
        self._check_not_forked(what)  # before taking `_calls`: a parent's thread may have held it at the fork
        with self._calls:
            self._check_open(what)
            self._running[call] = threading.get_ident()

    def _call_left(self, registered: int | None) -> None:
        """Wake close() for a call that `_enter_call` registered (`registered`: what the pop returned). A refused
        call (closed, or in a forked child) never registered and takes no lock: a parent's thread may have held
        `_calls` at the fork."""
        if registered is None:
            return
        with self._calls:
            self._call_ended.notify_all()

    def _bounded(self, deadline: Deadline | None) -> float:
        """What is left of close()'s `deadline` for a wait that must end: with no limit (wait_timeout_secs None)
        or no deadline, `save.wait_timeout_secs`'s default."""
        left = deadline.left() if deadline is not None else None
        return self._ctx.timeout_s if left is None else left

    def _timeout_said(self) -> str:
        """close()'s timeout as its messages name it: the one set, never what was left of it."""
        set_s = self._save_config.wait_timeout_secs
        return f"{self._ctx.timeout_s if set_s is None else set_s}s (save.wait_timeout_secs)"

    def _wait_for_running_calls(self, deadline: Deadline) -> None:
        """Calls on this thread are not waited for: close() inside them would wait for itself."""
        me = threading.get_ident()
        timeout = self._bounded(deadline)  # save.wait_timeout_secs, or its default when None: always bounded
        if not self._call_ended.wait_for(self._calls, lambda: not (set(self._running.values()) - {me}), timeout):
            logger.error(
                "close(): a save()/load() on another thread was still running after %s; closing anyway, so that "
                "call fails with the writer stopped under it.",
                self._timeout_said(),
            )

    def _checkpoint_path(self, checkpoint_id: Any) -> str:
        """The id as the storage will see it: `~` expanded, `file://` a path; a URL only where the storage takes
        URLs. Without a storage config, the first id picks the storage (`_pick_storage`)."""
        checkpoint_id = _id_text(checkpoint_id)
        if not isinstance(checkpoint_id, str):
            raise ConfigTypeError(
                f"A checkpoint id must be a str or a path (e.g. 'runs/step_100'), got {checkpoint_id!r} "
                f"({type(checkpoint_id).__name__})."
            )
        if "\x00" in checkpoint_id:  # no path holds one: a bare "embedded null byte" ValueError, naming nothing
            raise ConfigError(f"Checkpoint id {checkpoint_id!r} holds a NUL character, which no path can; remove it.")
        refuse_unencodable("Checkpoint id", checkpoint_id)  # a bare "surrogates not allowed" from the first mkdir
        url = _URL.match(checkpoint_id)
        scheme = url.group(1).lower() if url is not None else None
        if scheme is not None and self._storage.handles_url(checkpoint_id):
            return checkpoint_id
        if scheme in LOCAL_SCHEMES and self._expands_home():  # the local filesystem: a file:// id is its path
            checkpoint_id, scheme = local_path_of(checkpoint_id), None
        normal = checkpoint_id if scheme is not None else _local_path(checkpoint_id, self._expands_home())
        if scheme is None and not posixpath.isabs(normal):
            _check_working_directory(normal)
        if self.config.storage_config is None:
            self._pick_storage(scheme, normal)
        else:
            _check_storage_takes(self.config.storage_config, scheme, normal)
        return normal

    def _expands_home(self) -> bool:
        """Whether a scheme-less id's leading `~` is the home directory, and a `file://` id the local path it
        names (`discovery.expands_home`: the storage is the local filesystem, whatever config built it); without
        a storage config a scheme-less id is a local path, whichever store an earlier URL id picked."""
        return self.config.storage_config is None or expands_home(self._storage)

    def _pick_storage(self, scheme: str | None, checkpoint_id: str) -> None:
        """The first id fixes the storage of a manager built without one; later ids must be of that storage.

        One storage per manager, because the saver, the loader and the async writer process each hold it: a
        URL first id replaces the local storage built at construction (restarting the writer process, before
        any checkpoint went through it), and switching back and forth would do that on every save.
        """
        if self._first_id is None:
            if scheme is not None:
                storage = fsspec_storage_for(scheme, checkpoint_id)
                self._detach_storage()
                self._attach_storage(storage.config, storage)
            self._first_id = (scheme, checkpoint_id)
            return
        first_scheme, first_id = self._first_id
        if scheme != first_scheme:
            raise ConfigError(
                f"Checkpoint id {checkpoint_id!r} is on {_store_name(scheme)}, but this manager's storage was "
                f"picked by its first id {first_id!r} ({_store_name(first_scheme)}): a manager built without "
                f"storage_config keeps the storage its first id selects (docs/storage.md). Use another "
                f"CheckpointManager for {_store_name(scheme)}."
            )

    def _say_rank_local_metrics(self, what: str, reports: list[dict[str, Any]]) -> None:
        """The manifest records rank 0's metrics=. A rank-local value (the guide's `loss.item()` on each rank of a
        data-parallel job) differing across ranks is no reason to refuse a save, but the others' values are not
        recorded: rank 0 says so once per manager, naming the fix for a job-wide value."""
        differ = sorted(r for r, rep in enumerate(reports) if rep["metrics"] != reports[0]["metrics"])
        if not differ or self._metrics_said or self._ctx.rank != 0:
            return
        self._metrics_said = True
        logger.warning(
            "%s: ranks %s pass other metrics= than rank 0 (%s); the checkpoint records rank 0's, which retention's "
            "keep_best and list_checkpoints then use. For a job-wide value, reduce it first (e.g. "
            "dist.all_reduce(loss, op=ReduceOp.AVG)) and pass the same metrics on every rank. (Said once per "
            "manager.)",
            what,
            differ,
            reports[0]["metrics"],
        )

    def _plan(self, request: _SaveRequest) -> SavePlan:
        """`_plan_together`; a rank that leaves between its two steps answers the second (`GroupTransport.leave`)."""
        transport = self._ctx.transport.for_steps(_PLAN_STEP, _TARGET_STEP)
        agreed: list[Callable[[], SavePlan]] = []  # the plan, once the second step is under way
        try:
            return self._plan_together(transport, agreed, request)
        except BaseException as exc:
            transport.leave(exc)
            if agreed and transport.agreed_every_step() and not isinstance(exc, Exception):
                refuse_interrupted_write(agreed[0](), exc)
            raise

    def _plan_together(
        self,
        transport: GroupTransport,
        agreed: list[Callable[[], SavePlan]],
        request: _SaveRequest,
    ) -> SavePlan:
        """Agree with the other ranks on what is saved where, then name the temporary directory.

        Two agreed steps (`agreement.agree`): every rank's resolved items, id and item set; then rank 0's check
        of the target and its sharding metadata. Any refusal, on any rank, is the same `CommitError` everywhere.
        """
        ctx, seq = self._ctx, self._seq + 1
        checkpoint_id, payload = request.checkpoint_id, request.payload
        resolved: list[ResolvedItem] = []

        def report() -> dict[str, Any]:
            self._recheck_config()  # in the agreed step: a config changed on one rank is refused on every rank
            self._saver.check_can_save(checkpoint_id)  # inside lock() on this thread: refused on every rank
            self._refuse_process_local(checkpoint_id)
            self._saver.settle_previous()  # a previous async save's unseen failure is refused on every rank
            _refuse_live_objects(payload)
            resolved.extend(resolve(payload, self.config.items, self.config.default, ctx.rank))
            _refuse_shards_in_one_file(resolved, ctx.world_size)
            if self._storage.local_path(Path(checkpoint_id)) is not None:
                _check_paths_fit(checkpoint_id, temporary_name(checkpoint_id, ctx.uid, seq), resolved)
            self._saver.refuse_unencodable(resolved)  # an async save encodes in its writer: refused here instead
            if self._load_config.weights_only:  # this manager's own load would refuse what torch's loader refuses
                self._safe_load.warn_refused(resolved)
            metadata = self._metadata.extract_object_metadata(resolved) if self._metadata else None
            keys = sorted(i.key for i in resolved)
            layouts = _layout_report(resolved)
            resharders = {i.key: _resharder_name(i) for i in resolved if i.spec.resharder is not None}
            return {
                "id": checkpoint_id,
                "seq": seq,
                "step": request.step,
                "metrics": _comparable_metrics(request.metrics),
                "keys": keys,
                "resharders": resharders,
                "layouts": layouts,
                "metadata": metadata,
            }

        # The ids may differ (that is one of the refusals), so the plan's step is named without one.
        reports = agree(_PLAN_STEP, transport, report)
        what = f"Checkpoint save of {reports[0]['id']}"
        _check_same_save(what, reports, ("id", "seq", "step"))
        self._say_rank_local_metrics(what, reports)
        self._shared_said.update(i.key for i in resolved if isinstance(i.spec.layout, ReplicatedLayoutInfo))
        left_to_others = _shared_paths([rep["layouts"] for rep in reports], ctx.rank, self._shared_said)
        _check_same_save(what, reports, ("keys", "resharders"))
        items = [i for i in resolved if i.key not in left_to_others]

        made: tuple[MadeDirectory, ...] = ()

        def target() -> str | None:
            nonlocal made
            if ctx.rank != 0:
                return None
            check_target(self._storage, checkpoint_id, self._save_config.overwrite)
            # Made by rank 0 before any other rank gets past this step, so rank 0 knows every parent the save
            # created; a failure anywhere from here removes them again (`remove_made`).
            try:
                made = make_parents(self._storage, checkpoint_id)
            except OSError as exc:  # a bare "Permission denied: 'runs/a'" named neither the save nor the fix
                explained = explained_disk_fault(exc, checkpoint_id)
                if explained is None:
                    raise
                raise explained from exc
            if self._metadata is None:
                return None
            layouts = [{key: layout for key, (_, layout) in rep["layouts"].items()} for rep in reports]
            return self._metadata.serialize([rep["metadata"] for rep in reports], layouts)

        def planned(metadata_json: str | None) -> SavePlan:
            self._seq = seq
            return self._save_plan(request, seq, items, metadata_json, made)

        agreed.append(lambda: planned(None))  # what a rank that leaves once this step is agreed refuses (`_plan`)
        try:
            metadata_json = agree(f"{what}: {_TARGET}", transport, target)[0]
        except BaseException:  # the metadata (a resharder's to_dict), or another rank, failed after they were made
            remove_made(made)
            raise
        return planned(metadata_json)

    def _save_plan(
        self,
        request: _SaveRequest,
        seq: int,
        items: list[ResolvedItem],
        metadata_json: str | None,
        made: tuple[MadeDirectory, ...],
    ) -> SavePlan:
        """The agreed save's plan for this rank (`metadata_json`: rank 0's)."""
        ctx, checkpoint_id = self._ctx, request.checkpoint_id
        # No rank but 0 creates a directory: rank 0 made (and recorded) the id's missing parents in the agreed
        # step. Each rank's own `mkdir` here, recorded nowhere, was left behind by a save that failed.
        final = Path(checkpoint_id)
        store = None
        if ctx.store_address is not None:
            store = StoreAddress(ctx.store_address.host, ctx.store_address.port, f"{ctx.store_address.namespace}/{seq}")
        return SavePlan(
            checkpoint_dir=checkpoint_id,
            tmp_dir=temporary_name(checkpoint_id, ctx.uid, seq),
            rank=ctx.rank,
            world_size=ctx.world_size,
            items=tuple(items),
            metadata_json=metadata_json if ctx.rank == 0 else None,
            store=store,
            timeout_s=ctx.timeout_s,
            pre_finalize_callback=self.config.pre_finalize_callback,
            finalize_callback=self.config.finalize_callback,
            step=request.step,
            metrics=request.metrics,
            overwrite=self._save_config.overwrite,
            started=request.started,
            made=made,
            # An object store's checkpoint is named by its URL (a local one as the id: made absolute for the writer).
            shown=shown_name(self._storage, checkpoint_id) if self._storage.local_path(final) is None else "",
        )


@dataclass(frozen=True)
class _SaveRequest:
    """One `save` call's checked arguments, as its plan steps (`_plan`, `_plan_together`, `_save_plan`) pass
    them on: one parameter, where each step restated all five."""

    checkpoint_id: str
    payload: Mapping[str, Any]
    step: int | None
    metrics: dict[str, float] | None
    started: float


def _validate_parts(config: CheckpointManager.Config) -> None:
    """The loader, storage, writer-process and callback fields of `Config`."""
    owner = "CheckpointManager.Config"
    check_instance(owner, "load", config.load, CheckpointLoaderConfig, "Leave it unset for the default.")
    _check_optional(
        "storage_config",
        config.storage_config,
        StorageConfig,
        "a StorageConfig (e.g. LocalFileSystemStorageConfig(), FsspecStorageConfig(url=...)), or None for the "
        "local filesystem; a directory goes in the checkpoint id, not here",
    )
    _check_optional("retention", config.retention, RetentionPolicy, "a RetentionPolicy(keep_last=...) or None")
    for name in ("subprocess_init_fn", "pre_finalize_callback", "finalize_callback"):
        value = getattr(config, name)
        if value is not None and not callable(value):
            raise ConfigTypeError(
                f"{owner}.{name} must be a function (importable, e.g. defined at module level) or None, got "
                f"{value!r} ({type(value).__name__})."
            )
    if isinstance(config.save, AsyncCheckpointSaverConfig):
        for name in ("pre_finalize_callback", "finalize_callback"):
            error = callback_unpicklable(owner, name, getattr(config, name))
            if error is not None:
                raise error
    if not isinstance(config.subprocess_init_args, (tuple, list)):
        raise ConfigTypeError(
            f"{owner}.subprocess_init_args must be a tuple of the arguments for subprocess_init_fn, got "
            f"{config.subprocess_init_args!r} ({type(config.subprocess_init_args).__name__}); one argument x "
            f"is (x,)."
        )


def _warn_refused_layouts(config: CheckpointManager.Config, world_size: int) -> None:
    """Name, when the manager is built, each layout that every `save()` of a `world_size` job will refuse (a path
    no save may write, a file or folder name over NAME_MAX bytes at its largest rank, the default
    `<key>_<rank>.pt` of a long key too).

    The refusal itself stays in `save()`, where API_SURFACE §4 places it; but an async manager's first save may
    come hours into training, and until then nothing was said."""
    specs = [(f"Config.items[{key!r}]", "this item", key, spec.layout) for key, spec in config.items.items()]
    if config.default is not None and config.default.layout is not None:
        specs.append(
            ("Config.default", "a key without its own ItemSpec", "<any key without an ItemSpec>", config.default.layout)
        )
    for where, what, key, layout in specs:
        try:
            if layout is None:
                layout = default_layout_info(key, world_size - 1)
            else:
                check_layout(key, layout)
            check_names_fit(key, layout, world_size)
        except (ConfigError, ConfigTypeError) as exc:
            logger.warning("CheckpointManager.%s: every save() of %s will be refused: %s", where, what, exc)


def _check_optional(name: str, value: Any, cls: type, what: str) -> None:
    if value is not None and not isinstance(value, cls):
        raise ConfigTypeError(
            f"CheckpointManager.Config.{name} must be {what}, got {value!r} ({type(value).__name__})."
        )


def _wants_metadata(config: CheckpointManager.Config) -> bool:
    return any(s.resharder is not None for s in [*config.items.values(), config.default] if s)


# The configuration dataclasses a manager builds its saver, loader, storage and retention from, at construction.
_FIXED_CONFIGS = ("save", "load", "storage_config", "retention")

# Read at each call (and checked then by `_validate`); every other Config field is fixed at construction.
_LIVE_FIELDS = frozenset({"items", "default", "pre_finalize_callback", "finalize_callback"})


@dataclass(frozen=True, eq=False)
class _Same:
    """A user object in the snapshot: compared by identity, never copied (it stays shared with the caller)."""

    value: Any

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


_PLAIN = (bool, int, float, complex, str, bytes, type(None), enum.Enum)


def _fixed_fields(config: CheckpointManager.Config) -> dict[str, Any]:
    """The construction-only fields of `config`, flattened to {dotted path: plain value or `_Same`}."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.name not in _LIVE_FIELDS:
            # A storage config's dicts (storage_options) go to the store's client library, which fills them in
            # (botocore adds to a `retries` dict): compared as objects, not walked, or that looked like a change.
            _flatten(getattr(config, f.name), f.name, out, walk_dicts=f.name != "storage_config")
    return out


def _flatten(value: Any, path: str, out: dict[str, Any], walk_dicts: bool = True) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out[path] = type(value)  # a replaced object of another type is a change too
        for f in dataclasses.fields(value):
            _flatten(getattr(value, f.name, None), f"{path}.{f.name}", out, walk_dicts)
    elif isinstance(value, (list, tuple)):
        out[path] = (type(value), len(value))
        for i, item in enumerate(value):
            _flatten(item, f"{path}[{i}]", out, walk_dicts)
    elif isinstance(value, dict) and walk_dicts:
        out[path] = (dict, tuple(map(repr, value)))
        for key, item in value.items():
            _flatten(item, f"{path}[{key!r}]", out)
    else:
        value = _as_taken(value)
        out[path] = value if isinstance(value, _PLAIN) else _Same(value)


def _as_taken(value: Any) -> Any:
    """A number as the plain int or float the config's checks take it as (numpy's integers and floats, a 0-d
    tensor); anything else as it is. Compared as the object itself, `np.int64(5)` set on a field built as 5 was
    refused as "changed after this manager was built"."""
    try:
        return real_as_number("", value)
    except ConfigError:  # past a float: the field's own check refuses it, naming it
        return value


def _changed_fields(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The dotted paths whose value differs."""
    return [
        path
        for path in sorted(before.keys() | now.keys())
        if not _same_value(before.get(path), now.get(path)) or (path in before) != (path in now)
    ]


def _same_value(a: Any, b: Any) -> bool:
    """Whether two snapshot values are one: NaN is never equal to itself, and a numpy or torch NaN taken as a
    float (`_as_taken`) is a new float at each look, so two NaN floats are the same value (compared by identity
    only, an untouched `np.float64("nan")` was "changed after this manager was built")."""
    if a is b or a == b:
        return True
    return type(a) is float and type(b) is float and math.isnan(a) and math.isnan(b)


def _not_a_config(value: object) -> str:
    """The refusal of a `config` argument that is no `CheckpointManager.Config`, with the fix for the likely
    mix-up: it failed later, naming an attribute (`'str' object has no attribute 'items'`) or a field the
    caller never set."""
    name = getattr(value, "__name__", "")
    if value is CheckpointManager.Config:
        fix = "pass an instance: CheckpointManager.Config()"
    elif callable(value) and name in ("with_sync_save", "with_async_save"):
        fix = f"call the preset: CheckpointManager.Config.{name}()"
    elif isinstance(value, Mapping):
        fix = "build the config from those fields: CheckpointManager.Config(**fields)"
    elif isinstance(value, (SyncCheckpointSaverConfig, AsyncCheckpointSaverConfig)):
        fix = "put it in the config: CheckpointManager(CheckpointManager.Config(save=...))"
    elif isinstance(value, (str, os.PathLike)):
        fix = "a directory is no config: it goes in the checkpoint id of save() and load()"
    else:
        fix = "e.g. CheckpointManager.Config(items={...}) or CheckpointManager.Config.with_sync_save()"
    return (
        f"CheckpointManager(config=...) must be a CheckpointManager.Config or None, got {type(value).__name__} "
        f"({value!r:.80}); {fix}."
    )


def _unsupported_saver(save: Any) -> str:
    """API_SURFACE §2.2's refusal of `Config.save`, with the fix."""
    return (
        f"Unsupported saver_config type: {type(save).__name__}. Config.save must be a SyncCheckpointSaverConfig or an "
        f"AsyncCheckpointSaverConfig (or build the config with CheckpointManager.Config.with_sync_save() / "
        f"with_async_save())."
    )


def _id_text(checkpoint_id: Any) -> Any:
    """A path-like id as its text, its `~` a folder of that name (`config.home_expanded`: a `Path`'s `~` is
    literal, a `str`'s the home directory where the storage is local); any other id as it is, for the caller to
    take or refuse. The one reading of a path-like id: a save's, a load's, and what the ranks compare."""
    if not isinstance(checkpoint_id, os.PathLike):
        return checkpoint_id
    text = os.fspath(checkpoint_id)
    return literal_tilde(text) if isinstance(text, str) else text


def _local_path(checkpoint_id: str, expand_home: bool) -> str:
    """A scheme-less id, normalised; a leading `~` expanded where `expand_home` (the local filesystem), not under
    an object store's root, where '~/a' is a key (as `discovery.user_path` reads it), and was refused as the home
    directory's absolute path."""
    if expand_home:
        checkpoint_id = os.path.expanduser(checkpoint_id)
    normal = posixpath.normpath(checkpoint_id) if checkpoint_id.strip() else ""
    if normal.strip("/") in ("", ".", "..") or normal.endswith(("/..", "/.")):  # normpath keeps a leading "//"
        raise ConfigError(
            f"Checkpoint id {checkpoint_id!r} names no directory of its own; pass a path such as 'runs/step_100'."
        )
    return literal_tilde(normal)


def _check_working_directory(checkpoint_id: str) -> None:
    """A relative id needs a working directory: one deleted after the program changed into it made every call a
    bare FileNotFoundError from deep inside the engine, naming neither the id nor why."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"Checkpoint id {checkpoint_id!r} is relative, but the working directory of this process no longer "
            f"exists (it was deleted after the program changed into it), so the id names no place. Pass an "
            f"absolute id, or os.chdir() to a directory that exists. Nothing was done",
            checkpoint_id,
        ) from None


def _check_saveable_name(path: str) -> None:
    """Refuse, before anything is planned, an id whose own name no listing shows or no directory can take.

    Names starting with '.' are the engine's own (temporaries `.x.tmp-...`, trash `.x.trash-...`, copies set
    aside `.old_x_...`): listings, retention and `latest_checkpoint` skip them, and gc removes or renames
    those that match its patterns, so a checkpoint saved as `run/.last` was never found for a resume. A name
    over NAME_MAX bytes was refused by the final rename, after every byte was written.
    """
    name = posixpath.basename(path.rstrip("/"))
    if name.startswith("."):
        raise ConfigError(
            f"Checkpoint id {path!r}: its name {name!r} starts with '.', which this engine keeps for its own "
            f"temporary and trash directories; listings and latest_checkpoint() never show such a checkpoint, and "
            f"gc may remove it. Drop the leading '.' (e.g. {name.lstrip('.') or 'last'!r})."
        )
    size = len(os.fsencode(name))
    if size > NAME_MAX:
        raise ConfigError(
            f"Checkpoint id {path!r}: its name is {size} bytes, over the {NAME_MAX}-byte limit of a file name; "
            f"use a shorter name. Nothing was saved."
        )


def _check_components_fit(path: str) -> None:
    """Refuse a local id with a directory name over NAME_MAX bytes before anything is created: the save failed
    with a bare ENAMETOOLONG after making the id's parents above that name, which stayed behind."""
    for part in path.split("/"):
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            raise ConfigError(
                f"Checkpoint id {path!r}: its directory name {part[:40]}... is {size} bytes, over the {NAME_MAX}-byte "
                f"limit of a file name; use a shorter name. Nothing was saved."
            )


def _check_paths_fit(checkpoint_id: str, tmp: str, items: list[ResolvedItem]) -> None:
    """Refuse a local id whose temporary directory and files would pass PATH_MAX, before anything is created:
    the id itself may fit while `<parent>/.<name>.tmp-<uid>-<seq>/<item file>` does not (ENAMETOOLONG from the
    writer, after the id's parents were made)."""
    names = [i.layout.file_path for i in items] + [MANIFEST_FILE_NAME, METADATA_FILE_NAME, INCOMPLETE_MARKER]
    longest = os.path.join(os.path.abspath(tmp), max(names, key=lambda n: len(os.fsencode(n))))
    size = len(os.fsencode(longest))
    if size >= PATH_MAX:
        raise ConfigError(
            f"Checkpoint id {checkpoint_id!r}: the save would write {longest[:60]}...{longest[-40:]}, a path of "
            f"{size} bytes, over the PATH_MAX limit of {PATH_MAX - 1}; use a shorter id (fewer or shorter "
            f"directories) or shorter item file paths. Nothing was saved."
        )


def _store_name(scheme: str | None) -> str:
    return "the local filesystem" if scheme is None else f"the {scheme}:// store"


def _check_storage_takes(storage_config: StorageConfig, scheme: str | None, checkpoint_id: str) -> None:
    """An id the configured storage cannot take is refused here, naming the storage and the fix.

    (URL ids the storage takes never reach this check.)
    """
    name = type(storage_config).__name__
    if scheme is not None:
        local = isinstance(storage_config, LocalFileSystemStorageConfig)
        why = f"it writes local paths, and would create a directory named '{scheme}:'" if local else "not its scheme"
        raise ConfigError(
            f"Checkpoint id {checkpoint_id!r} is a {scheme}:// URL, but the configured storage ({name}) does not "
            f"take it ({why}). Configure a storage for {scheme}:// (CheckpointManager.Config.storage_config, e.g. "
            f"FsspecStorageConfig(url='{scheme}://bucket/prefix'); or leave it unset, and the first id picks the "
            f"storage: docs/storage.md), or pass an id of the configured storage."
        )
    if isinstance(storage_config, FsspecStorageConfig) and not storage_config.handles(checkpoint_id):
        raise ConfigError(
            f"Checkpoint id {checkpoint_id!r} is a local path, but the configured storage ({name}) has no url root "
            f"to place it under. Pass a full URL ('{storage_config.protocol or 's3'}://bucket/run/step_100'), or "
            f"set FsspecStorageConfig.url."
        )


@dataclass(frozen=True)
class _Parts:
    """What a manager holds outside itself, for releasing it after the manager is gone (never the manager)."""

    pid: int
    exit_hook: Callable[..., None]  # `_close_at_exit`, unregistered once the dropped manager is closed
    saver: CheckpointSaver
    wait_timeout: float | None  # save.wait_timeout_secs: the last save's wait and the retention passes', together
    loader: CheckpointLoader
    retention: RetentionRunner | None
    owner: OwnerLock
    # The manager's gloo group and, on rank 0, the TCPStore its writers commit through: held until the last
    # save is done (a dropped manager's store went with it, under its in-flight commit), then released.
    ctx: RankContext


def _close_dropped(parts: _Parts) -> None:
    """A manager collected without close(): say so, then close its parts on a thread of its own.

    Its own thread, because the last save may still be in flight (it completes, waited for as at exit: at most
    `save.wait_timeout_secs`) and whatever dropped the manager must not wait for it; not a daemon, so that an
    interpreter exiting meanwhile still waits for that save. Everything is released without a collective: the
    process group is destroyed locally (each rank's own manager releases its half when it is dropped). In a
    child made by os.fork() nothing is the child's to close: the writer, and the owner lock's open file, are
    the parent's.
    """
    if os.getpid() != parts.pid:
        return
    log_safely(
        logger,
        logging.WARNING,
        "A CheckpointManager (rank %d of %d) was dropped without close(): its last save is waited for (at most "
        "save.wait_timeout_secs), then its writer, threads%s are released in the background. Call close() "
        "(or build it in `with CheckpointManager(config) as manager:`) so that this happens where you choose.",
        parts.ctx.rank,
        parts.ctx.world_size,
        ", process group and store" if parts.ctx.world_size > 1 else "",
    )

    def close() -> None:  # close()'s order: the last save, its retention pass, then the writer
        try:
            deadline = Deadline(parts.wait_timeout)
            _wait_for_last_save(parts.saver, deadline.left(), "A CheckpointManager dropped without close()")
            if parts.retention is not None:
                left = deadline.left()
                parts.retention.close(parts.ctx.timeout_s if left is None else left)
            parts.saver.close()
            parts.loader.close()
        except Exception:
            log_safely(
                logger, logging.ERROR, "Closing a CheckpointManager dropped without close() failed", exc_info=True
            )
        finally:
            atexit.unregister(parts.exit_hook)
            parts.owner.release()
            parts.ctx.close()

    try:
        start_thread(threading.Thread(target=close, name="ckpt-dropped-close"))
    except RuntimeError:  # at interpreter shutdown no thread starts: the exit hook closes the saver
        parts.owner.release()


def _close_at_exit(saver: CheckpointSaver, timeout: float | None, owner_pid: int, at_exit: bool = True) -> None:
    """Wait (bounded) for the last save, then close the saver: at interpreter exit, or for a dropped manager.

    At exit with a save still being written, say so first: the process otherwise sat there, up to
    `save.wait_timeout_secs`, with nothing on the log to tell a finished script from a hung one.
    """
    if os.getpid() != owner_pid:
        return  # a child made by os.fork() exits: the writer and its last save are the parent's
    in_flight = saver.write_in_flight() if at_exit else None
    if in_flight is not None:
        log_safely(
            logger,
            logging.WARNING,
            "At interpreter exit, the async save of %s is still being written; the process waits for it (%s, "
            "save.wait_timeout_secs) before it ends. Call close() (or the save's Future's result()) before the "
            "script ends to wait where you choose.",
            in_flight,
            "with no bound" if timeout is None else f"at most {timeout} s",
        )
    try:
        _wait_for_last_save(saver, timeout, "At interpreter exit" if at_exit else "A dropped CheckpointManager")
    finally:
        saver.close()


def _wait_for_last_save(saver: CheckpointSaver, timeout: float | None, who: str) -> None:
    """Wait (bounded) for the last save where nobody is left to raise to: its failure is logged."""
    try:
        saver.wait(timeout)
    except Exception as exc:
        logger.error("%s, the last checkpoint save: %s: %s", who, type(exc).__name__, exc)


def _refuse_live_objects(payload: Any) -> None:
    """A module or optimizer pickles (so the save "works") but cannot be restored into: refuse it now."""
    if not isinstance(payload, Mapping):
        return  # resolve() names the problem
    for key, value in payload.items():
        if isinstance(value, torch.nn.Module):
            raise ConfigTypeError(
                f"Item '{key}' is a torch.nn.Module ({type(value).__name__}); save its state instead: pass "
                f"model.state_dict() (and load into model.state_dict())."
            )
        if isinstance(value, torch.optim.Optimizer):
            raise ConfigTypeError(
                f"Item '{key}' is a torch.optim.Optimizer ({type(value).__name__}); save its state instead: pass "
                f"optimizer.state_dict() (and restore with optimizer.load_state_dict())."
            )


def _refuse_shards_in_one_file(items: list[ResolvedItem], world_size: int) -> None:
    """A layout without `{rank}` is one file for every rank, written once by the lowest: a DTensor sharded over
    the ranks then kept rank 0's shard only, and every other rank loaded rank 0's shard as its own (no error,
    strict or not). Refused before anything is written, on every rank (the plan's agreement)."""
    if world_size <= 1:
        return
    for item in items:
        if item.is_default_layout or "{rank}" in item.spec.layout.file_path:  # type: ignore[union-attr]
            continue
        for path, leaf in iter_leaves(item.value):
            if is_dtensor(leaf) and any(p.is_shard() for p in leaf.placements):
                where = f"{item.key}::{dotted_key(path)}" if path else item.key
                raise ConfigError(
                    f"Item '{item.key}' holds a sharded DTensor at '{where}' (placements {tuple(leaf.placements)}), "
                    f"but its layout {item.spec.layout.file_path!r} has no '{{rank}}': one file cannot hold every "  # type: ignore[union-attr]
                    f"rank's shard (only rank 0's would be written, and every rank would load it). Put '{{rank}}' "
                    f"in LayoutInfo.file_path, and declare ItemSpec(resharder=DTensorResharder()) to load it on "
                    f"another world size."
                )


_DISAGREEMENTS = {
    "id": "saves {mine!r} while rank 0 saves {first!r}",
    "seq": "is at save #{mine} of this manager while rank 0 is at #{first}",
    "keys": "saves items {mine} while rank 0 saves {first}",
    # A resharder on some ranks only: its sharding metadata was dropped silently, or the save failed with a bare
    # TypeError naming nothing.
    "resharders": "declares resharders {mine} (item: class) while rank 0 declares {first}",
    # The manifest records one step (latest_checkpoint orders by it): rank 0's was kept, the others' dropped.
    "step": "passes step={mine} while rank 0 passes step={first}",
}


def _resharder_name(item: ResolvedItem) -> str:
    return type(item.spec.resharder).__qualname__


def _check_same_save(what: str, reports: list[dict[str, Any]], fields: tuple[str, ...]) -> None:
    """Every rank must save the same id and step, as the same save of the sequence, with the same keys."""
    failures: dict[int, str] = {}
    for rank, rep in enumerate(reports[1:], start=1):
        for name in fields:
            if rep[name] != reports[0][name]:
                failures[rank] = _DISAGREEMENTS[name].format(mine=rep[name], first=reports[0][name])
                break
    if failures:
        reasons = "; ".join(f"rank {r} {why}" for r, why in sorted(failures.items()))
        raise CommitError(
            f"{what}: the ranks disagree on what to save ({reasons}). Every rank must call save() with the same "
            f"id and step=, the same item keys and the same ItemSpec resharders. Nothing was committed.",
            failures,
        )


def _step_of(checkpoint_id: str) -> int | None:
    """The trailing integer of the id's last component (`runs/step_0100` -> 100), else None."""
    match = re.search(r"([0-9]+)$", posixpath.basename(checkpoint_id.rstrip("/")))
    return int(match.group(1)) if match else None


def _checked_step(step: Any) -> int:
    """A non-negative int: steps order checkpoints for `latest`, and an id's own trailing step is never negative.
    A numpy or 0-d tensor step (a training loop's counter) is taken as its int, as every integer argument is."""
    step = integer_as_int(step)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigTypeError(f"save(step=...) must be an int (or None: the id's trailing number), got {step!r}.")
    if step < 0:
        raise ConfigError(
            f"save(step={step}) is negative; a step orders checkpoints (latest_checkpoint() picks the highest): "
            f"pass the training step (0 or more), or None to take the id's trailing number."
        )
    return step


def _comparable_metrics(metrics: dict[str, float] | None) -> dict[str, float | str] | None:
    """The metrics as the ranks compare them: a NaN (a diverged loss, on every rank) equals itself."""
    if metrics is None:
        return None
    return {name: "nan" if math.isnan(value) else value for name, value in metrics.items()}


def _checked_metrics(metrics: Mapping[str, float] | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise ConfigTypeError(f"save(metrics=...) must be a Mapping of name -> float, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        value = integer_as_int(value)
        if not isinstance(name, str):
            raise ConfigTypeError(
                f"save(metrics=...): the name {name!r:.80} ({type(name).__name__}) must be a str, such as 'loss'"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigTypeError(_not_a_metric(name, value))
        try:
            out[name] = float(value)
        except OverflowError:
            raise ConfigError(
                f"save(metrics=...): entry {name!r} is an int of {len(str(abs(value)))} digits, past what a float "
                f"holds; pass it as a float (math.inf if that is what it means). Nothing was saved."
            ) from None
    return out


def _not_a_metric(name: str, value: object) -> str:
    """Why a metric is refused, with the fix: "must map a str to a number" said of np.float32(0.5), a number."""
    return (
        f"save(metrics=...): entry {name!r}: {value!r:.80} ({type(value).__name__}) is not a Python int or float; "
        f"pass float(value) (a numpy scalar's or 0-d tensor's number; a bool is no metric)"
    )


def _layout_report(items: list[ResolvedItem]) -> dict[str, tuple[str, Any]]:
    """Per item: the normalised file path this rank writes, and the layout to record (None = default)."""
    return {i.key: (posixpath.normpath(i.layout.file_path), None if i.is_default_layout else i.layout) for i in items}


def _shared_paths(per_rank: list[dict[str, tuple[str, Any]]], rank: int, said: set[str]) -> set[str]:
    """Keys whose file another, lower rank also writes: this rank leaves them to that rank.

    A layout without `{rank}` makes every rank target one file (the design document's warning). Rather than
    racing on it, the lowest rank writes it once and the others skip it with a warning — once per manager: keys in
    `said` (already warned about, or declared with a ReplicatedLayoutInfo) stay quiet. Two *different* keys
    resolving to one path across ranks are refused.
    """
    owners: dict[str, tuple[int, str]] = {}
    skip: dict[str, list[int]] = {}
    for r, report in enumerate(per_rank):
        for key, (path, _) in report.items():
            if path not in owners:
                owners[path] = (r, key)
                continue
            first_rank, first_key = owners[path]
            if first_key != key:
                reason = (
                    f"Item '{first_key}' on rank {first_rank} and item '{key}' on rank {r} would both write "
                    f"{path!r}. Give them distinct LayoutInfo.file_path values (with '{{rank}}' for per-rank files). "
                    f"Nothing was written."
                )
                raise CommitError(reason, {first_rank: reason, r: reason})
            skip.setdefault(key, [first_rank]).append(r)
    _refuse_file_under_file_across_ranks(owners)
    mine = {key for key, ranks in skip.items() if rank in ranks[1:]}
    if rank == 0:
        for key, ranks in sorted(skip.items()):
            if key in said:
                continue
            said.add(key)
            warnings.warn(
                f"Item '{key}' resolves to one file {per_rank[ranks[0]][key][0]!r} on ranks {ranks} (its layout has "
                f"no '{{rank}}'): only rank {ranks[0]} writes it, and every rank will read that copy. Put "
                f"'{{rank}}' in LayoutInfo.file_path for per-rank files, or declare a value that is the same on every "
                f"rank with ReplicatedLayoutInfo (this is said once per manager).",
                stacklevel=4,
            )
    return mine


def _refuse_file_under_file_across_ranks(owners: Mapping[str, tuple[int, str]]) -> None:
    """A file one rank writes that is the folder of a file another rank writes ('01' on rank 0, '01/y.pt' on
    rank 1: LayoutInfo('{rank}1') and LayoutInfo('0{rank}/y.pt')) can never both be written. Each rank's own
    paths are checked when resolved (`schema.resolve`); across ranks it failed mid-write, on whichever rank
    came second, with a bare IsADirectoryError or FileExistsError naming no item. Refused here, from the agreed
    reports, with the same CommitError on every rank before anything is written."""
    for path, (r, key) in owners.items():
        parent = posixpath.dirname(path)
        while parent:
            if parent in owners:
                parent_rank, parent_key = owners[parent]
                reason = (
                    f"Item '{key}' on rank {r} would be written to {path!r}, inside {parent!r}, the file of item "
                    f"'{parent_key}' on rank {parent_rank}: a path cannot be a file and a folder at once. Give them "
                    f"distinct LayoutInfo.file_path values (e.g. each under its own folder). Nothing was written."
                )
                raise CommitError(reason, {parent_rank: reason, r: reason})
            parent = posixpath.dirname(parent)


def _comparable_id(checkpoint_id: Any, expand_home: bool) -> str:
    """What ranks compare to tell that they load the same checkpoint: the id as given, paths normalised (a `~`
    expanded where `expand_home`, as `_local_path` does)."""
    text = _id_text(checkpoint_id)
    if not isinstance(text, str):
        return repr(checkpoint_id)
    if _URL.match(text):
        return text
    return literal_tilde(os.path.normpath(os.path.expanduser(text) if expand_home else text))


def _refuse_different_checkpoints(what: str, ids: list[str], commits: list[str | None]) -> None:
    """Every rank raises, before any copies, unless every rank opened the same id and, in it, the same commit.

    Ranks open the id one by one: a save replacing it meanwhile (a job re-saving a `latest` id) gave some ranks
    the old commit and others the new one, each whole and checked on its own, and the load restored a state mixed
    from two saves across ranks, silently. Each rank's commit is its pinned manifest, hashed."""
    if len(set(ids)) > 1:
        raise CheckpointError(
            f"{what}: the ranks load different checkpoints ({_by_rank(ids)}); nothing was restored on any "
            f"rank. Every rank must load the same id (decide it on one rank, e.g. latest_checkpoint() on "
            f"rank 0, and broadcast it)."
        )
    if len(set(commits)) > 1:
        shown = [c[:12] if c is not None else "no manifest" for c in commits]
        raise CheckpointError(
            f"{what}: the ranks opened different commits of it ({_by_rank(shown)}, each its manifest's SHA-256); "
            f"nothing was restored on any rank. Either a save replaced the checkpoint while the ranks opened it "
            f"(load again), or the id names different checkpoints on different ranks (a relative path, or "
            f"node-local copies that differ): every rank must load the same checkpoint."
        )


def _by_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
