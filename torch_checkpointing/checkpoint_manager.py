"""`CheckpointManager`: the one object user code talks to."""

from __future__ import annotations

import posixpath
import re
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_checkpointing.checkpoint_loader import CheckpointLoader
from torch_checkpointing.checkpoint_saver import AsyncCheckpointSaver, CheckpointSaver, SavePlan, SyncCheckpointSaver
from torch_checkpointing.config import (
    DEFAULT_WAIT_TIMEOUT_SECS,
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    CheckpointSaverConfig,
    SyncCheckpointSaverConfig,
)
from torch_checkpointing.metadata_manager import DefaultMetadataManager
from torch_checkpointing.discovery import OwnerLock, check_item_keys, self_describing_layouts
from torch_checkpointing.rank_context import RankContext
from torch_checkpointing.retention import RetentionPolicy, RetentionRunner
from torch_checkpointing.schema import ItemSpec, ResolvedItem, resolve, validate_keys
from torch_checkpointing.storage.base_storage import StorageConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.store_channel import StoreAddress

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves and loads checkpoints made of top-level items, each shaped by its `ItemSpec`.

    Construct one per training job on every rank (in a multi-rank job, construction, `save()` and `close()`
    are collective). Async managers start their writer process at construction.
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        items: Mapping[str, ItemSpec] = field(default_factory=dict)
        default: ItemSpec | None = field(default_factory=ItemSpec)
        save: CheckpointSaverConfig = field(default_factory=AsyncCheckpointSaverConfig)
        load: CheckpointLoaderConfig = field(default_factory=CheckpointLoaderConfig)
        storage_config: StorageConfig | None = None
        subprocess_init_fn: Callable[..., None] | None = None
        subprocess_init_args: tuple[Any, ...] = ()
        pre_finalize_callback: Callable[[str, Any], None] | None = None
        finalize_callback: Callable[[str, Any], None] | None = None
        # Which committed checkpoints to keep; applied by rank 0 after each commit (torch_checkpointing.retention).
        retention: RetentionPolicy | None = None

        def build(self) -> CheckpointManager:
            return CheckpointManager(self)

        @classmethod
        def with_sync_save(cls) -> CheckpointManager.Config:
            return cls(save=SyncCheckpointSaverConfig())

        @classmethod
        def with_async_save(cls) -> CheckpointManager.Config:
            return cls(save=AsyncCheckpointSaverConfig())

    def __init__(self, config: Config | None = None) -> None:
        self._closed = True  # until construction succeeds, so close()/__del__ do nothing
        config = config if config is not None else CheckpointManager.Config()
        self._validate(config)
        self.config = config
        storage_config = config.storage_config or LocalFileSystemStorageConfig()
        self._storage = storage_config.create_storage()
        timeout = config.save.wait_timeout_secs
        self._ctx = RankContext(float(timeout if timeout is not None else DEFAULT_WAIT_TIMEOUT_SECS))
        self._seq = 0
        wants_metadata = any(s.resharder is not None for s in [*config.items.values(), config.default] if s)
        self._metadata = DefaultMetadataManager() if wants_metadata else None
        self._saver: CheckpointSaver
        if isinstance(config.save, SyncCheckpointSaverConfig):
            self._saver = SyncCheckpointSaver(self._storage, config.save.writer_config)
        elif isinstance(config.save, AsyncCheckpointSaverConfig):
            self._saver = AsyncCheckpointSaver(
                config.save, storage_config, config.subprocess_init_fn, config.subprocess_init_args
            )
        else:
            raise TypeError(f"Unsupported saver_config type: {type(config.save).__name__}")
        self._loader = CheckpointLoader(self._storage, config.load, self._ctx.rank_info)
        self._owner = OwnerLock(self._ctx.uid)  # lets `gc` tell this job's live temporaries from dead ones
        self._retention = RetentionRunner(config.retention, self._ctx.rank, self._storage) if config.retention else None
        self._closed = False

    @staticmethod
    def _validate(config: Config) -> None:
        if not isinstance(config.items, Mapping):
            raise TypeError(f"Config.items must be a Mapping of key -> ItemSpec, got {type(config.items).__name__}")
        validate_keys(list(config.items))
        for key, spec in config.items.items():
            if not isinstance(spec, ItemSpec):
                raise TypeError(f"Config.items['{key}'] must be an ItemSpec, got {type(spec).__name__}")
        if config.default is not None and not isinstance(config.default, ItemSpec):
            raise TypeError(f"Config.default must be an ItemSpec or None, got {type(config.default).__name__}")

    # ---------------------------------------------------------------- public API

    @property
    def rank_info(self) -> Any:
        return self._ctx.rank_info

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
        self._check_open("save")
        step = _step_of(str(checkpoint_id)) if step is None else _checked_step(step)
        checked_metrics = _checked_metrics(metrics)
        plan = self._plan(str(checkpoint_id), checkpoint)
        plan.step, plan.metrics = step, checked_metrics
        write = self._saver.save(plan)
        if self._retention is not None:
            self._retention.after_commit(str(checkpoint_id), write)
        return write

    def load(
        self,
        checkpoint_id: str,
        into: Mapping[str, Any] | None = None,
        *,
        map_location: Any = None,
        strict: bool = False,
    ) -> Mapping[str, Any]:
        """Restore into `into`'s templates (tensors filled in place) and return the loaded mapping."""
        self._check_open("load")
        if into is None and not self.config.items:
            # Self-describing: every item, read with the layout and (safe) format its manifest records.
            layouts = self_describing_layouts(self._storage, str(checkpoint_id), self._ctx.rank, self._ctx.world_size)
            items = [ResolvedItem(k, None, ItemSpec(layout=lay), lay, False) for k, lay in layouts.items()]
            return self._loader.load(str(checkpoint_id), items, map_location=map_location, strict=strict)
        if into is None:
            into = {k: None for k in self.config.items}
        items = resolve(into, self.config.items, self.config.default, self._ctx.rank)
        check_item_keys(self._storage, str(checkpoint_id), [i.key for i in items if i.spec.required])
        return self._loader.load(str(checkpoint_id), items, map_location=map_location, strict=strict)

    def prewarm_staging(self, checkpoint: Mapping[str, Any]) -> None:
        """Allocate (and fill) the async staging buffers ahead of the first save."""
        self._check_open("prewarm staging")
        if isinstance(self._saver, AsyncCheckpointSaver):
            items = resolve(checkpoint, self.config.items, self.config.default, self._ctx.rank)
            self._saver.prewarm(items)

    def lock(self) -> AbstractContextManager[Any]:
        """Hold around in-place updates (optimizer.step()): waits only while a save's staging copy runs."""
        self._check_open("lock")
        if isinstance(self._saver, AsyncCheckpointSaver):
            return self._saver.lock()
        return nullcontext()

    def close(self) -> None:
        """Wait for the last write (re-raising its error), then stop the writer process."""
        if self._closed:
            return
        try:
            self._saver.wait(self.config.save.wait_timeout_secs)
        finally:
            self._closed = True
            if self._retention is not None:
                self._retention.close()
            self._owner.release()
            self._saver.close()
            self._loader.close()
            self._ctx.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"Cannot {what} with a closed CheckpointManager")

    def _plan(self, checkpoint_id: str, payload: Mapping[str, Any]) -> SavePlan:
        """Resolve the payload, agree with the other ranks, and name the temporary directory."""
        ctx = self._ctx
        local_error: Exception | None = None
        try:
            items = resolve(payload, self.config.items, self.config.default, ctx.rank)
            local_metadata = self._metadata.extract_object_metadata(items) if self._metadata else None
            report: Any = ("ok", _layout_report(items), local_metadata)
        except Exception as exc:
            if ctx.world_size == 1:
                raise
            local_error, report = exc, ("error", f"{type(exc).__name__}: {exc}", None)
        # Every rank learns about every other rank's refusal, so none is left waiting in a collective.
        reports = ctx.all_gather(report)
        failures = {r: rep[1] for r, rep in enumerate(reports) if rep[0] == "error"}
        if local_error is not None:
            raise local_error
        if failures:
            raise RuntimeError(f"Checkpoint save of {checkpoint_id} refused on rank(s) {failures}; nothing was written.")
        left_to_others = _shared_paths([rep[1] for rep in reports], ctx.rank)
        items = [i for i in items if i.key not in left_to_others]
        metadata_json = None
        if ctx.rank == 0 and self._metadata is not None:
            layouts = [{key: layout for key, (_, layout) in rep[1].items()} for rep in reports]
            metadata_json = self._metadata.serialize([rep[2] for rep in reports], layouts)
        self._seq += 1
        final = Path(checkpoint_id)
        self._storage.mkdir(final.parent if str(final.parent) else Path("."))
        tmp = final.parent / f".{final.name}.tmp-{ctx.uid}-{self._seq}"
        store = None
        if ctx.store_address is not None:
            store = StoreAddress(ctx.store_address.host, ctx.store_address.port, f"{ctx.store_address.namespace}/{self._seq}")
        return SavePlan(
            str(final),
            str(tmp),
            ctx.rank,
            ctx.world_size,
            items,
            metadata_json,
            store,
            ctx.timeout_s,
            self.config.pre_finalize_callback,
            self.config.finalize_callback,
        )


def _step_of(checkpoint_id: str) -> int | None:
    """The trailing integer of the id's last component (`runs/step_0100` -> 100), else None."""
    match = re.search(r"(\d+)$", posixpath.basename(checkpoint_id.rstrip("/")))
    return int(match.group(1)) if match else None


def _checked_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"save(step=...) must be an int, got {type(step).__name__}")
    return step


def _checked_metrics(metrics: Mapping[str, float] | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"save(metrics=...) must be a Mapping of name -> float, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"save(metrics=...): entry {name!r}: {value!r} must map a str to a number")
        out[name] = float(value)
    return out


def _layout_report(items: list[ResolvedItem]) -> dict[str, tuple[str, Any]]:
    """Per item: the normalised file path this rank writes, and the layout to record (None = default)."""
    return {i.key: (posixpath.normpath(i.layout.file_path), None if i.is_default_layout else i.layout) for i in items}


def _shared_paths(per_rank: list[dict[str, tuple[str, Any]]], rank: int) -> set[str]:
    """Keys whose file another, lower rank also writes: this rank leaves them to that rank.

    A layout without `{rank}` makes every rank target one file (the design document's warning). Rather than
    racing on it, the lowest rank writes it once and the others skip it with a warning. Two *different* keys
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
                raise ValueError(
                    f"Item '{first_key}' on rank {first_rank} and item '{key}' on rank {r} would both write "
                    f"{path!r}. Give them distinct LayoutInfo.file_path values (with '{{rank}}' for per-rank files). "
                    f"Nothing was written."
                )
            skip.setdefault(key, [first_rank]).append(r)
    mine = {key for key, ranks in skip.items() if rank in ranks[1:]}
    if rank == 0:
        for key, ranks in sorted(skip.items()):
            warnings.warn(
                f"Item '{key}' resolves to one file {per_rank[ranks[0]][key][0]!r} on ranks {ranks} (its layout has "
                f"no '{{rank}}'): only rank {ranks[0]} writes it, and every rank will read that copy. Put "
                f"'{{rank}}' in LayoutInfo.file_path for per-rank files.",
                stacklevel=4,
            )
    return mine
