"""Reading a checkpoint back into templates: a direct read of this rank's file, or a resharder's load.

The promise: `load()` returns exactly what was committed, or raises a `CheckpointError` naming the file and
the reason, having changed nothing in the caller's objects. So a load runs in two phases:

1. check: one `CheckpointReadContext` pins the directory and its manifest; every file any item will read is
   opened (contained, regular, listed), size-checked and CRC-verified (on threads, while the direct items are
   decoded); every template is dry-run merged (shapes, dtypes, types, missing and unexpected entries);
2. copy: only then are tensors `copy_()`-ed into the templates and the resharders run.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.serialization import default_restore_location

from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.codecs import OUT_OF_MEMORY, EnginePlacement, callers_placement
from torch_checkpointing.config import CheckpointLoaderConfig
from torch_checkpointing.distributed_metadata import (
    DistributedItemMetadata,
    DistributedMetadata,
    read_distributed_metadata,
)
from torch_checkpointing.encoding import decode
from torch_checkpointing.errors import (
    DECODE_ERRORS,
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    CorruptCheckpointError,
    MissingItemError,
    TemplateMismatchError,
    add_note,
    log_safely,
    raise_if_short_of_resources,
    undecodable,
)
from torch_checkpointing.json_dataclass import RebuildGaps
from torch_checkpointing.manifest import MANIFEST_FILE_NAME, Manifest
from torch_checkpointing.metadata_manager import check_extracted
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy, checked_relative_path
from torch_checkpointing.schema import ResolvedItem
from torch_checkpointing.signals import Held, signals_deferred
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.traversal import iter_leaves, leaves, local_tensor
from torch_checkpointing.types import CheckpointPath, RankInfo, checked_nested_path
from torch_checkpointing.walk_utils import (
    MISSING,
    check_shared_targets,
    overlapping_targets,
    walk_checkpoint_structure,
)

if TYPE_CHECKING:
    from torch_checkpointing.dtensor_resharder import ReshardJob
    from torch_checkpointing.types import NestedPath

_Copy = tuple[CheckpointPath, torch.Tensor, torch.Tensor]  # where, what the load writes, the template tensor

__all__ = ["CheckedLoad", "CheckpointLoader", "interrupted_note"]

logger = logging.getLogger("torch_checkpointing.checkpoint_loader")
# A direct decode also turns an OSError of the read into "cannot be decoded" (the file, named).
_DECODE_ERRORS_OR_OS: tuple[type[BaseException], ...] = (*DECODE_ERRORS, OSError)


@dataclass
class _Direct:
    item: ResolvedItem
    rel: str
    value: Any = None
    gaps: RebuildGaps = field(default_factory=RebuildGaps)  # a JSON item's keys and fields its class missed
    # Into a template: the copies of the values it returns as decoded, made by the check phase (`_Detached`).
    detached: _Detached | None = None


@dataclass
class _Reshard:
    item: ResolvedItem
    source: DistributedItemMetadata
    target: Any
    # A DTensorResharder's plan, made once: it names the files to verify, the check phase verifies its blocks
    # and the copy phase copies them. None for other resharders, whose `load` reads what it likes.
    job: ReshardJob | None = None


@dataclass
class _Copied:
    """What a load's copy phase did so far (it may run in two parts: `CheckedLoad.restore_unchecked`)."""

    loaded: dict[str, Any] = field(default_factory=dict)
    unhandled: list[CheckpointPath] = field(default_factory=list)
    before: _TemplatesBefore | None = None  # what the custom resharders' templates held before their `load`s
    engine_started: bool = False  # the engine began copying into the templates: no way back from here
    whole: bool = False  # every template holds the checkpoint (the copy phase ran to its end)

    def undo(self) -> None:
        """Put every custom resharder's template back as it was, and forget that they ran."""
        if self.before is not None:
            self.before.put_back()
            self.before = None
            self.loaded.clear()
            self.unhandled.clear()


@dataclass
class _TemplatesBefore:
    """What templates held before custom resharders' own `load`s ran (user code that writes into its template
    as it reads), so a failure of any of them puts every one back: they were run in item order, and one that
    failed left the items before it restored and its own partly written (issue #10: a failed load changes
    nothing in the caller's objects). Tensors are put back in place (the caller's own objects), dicts and
    lists get their entries back."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (template's, its values)
    containers: list[tuple[Any, Any]] = field(default_factory=list)  # (dict or list, its entries)

    @classmethod
    def of(cls, templates: list[Any]) -> _TemplatesBefore:
        before = cls()
        seen: set[int] = set()
        for template in templates:
            before._take(template, seen)
        return before

    def _take(self, node: Any, seen: set[int]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, torch.Tensor):
            local = local_tensor(node)
            self.tensors.append((local, local.detach().clone()))
        elif isinstance(node, Mapping):
            if isinstance(node, MutableMapping):
                self.containers.append((node, dict(node)))
            for child in node.values():
                self._take(child, seen)
        elif isinstance(node, Sequence) and not isinstance(node, str | bytes | bytearray):
            if isinstance(node, MutableSequence):
                self.containers.append((node, list(node)))
            for child in node:
                self._take(child, seen)

    def put_back(self) -> None:
        for container, entries in self.containers:
            if isinstance(container, MutableMapping):
                container.clear()
                container.update(entries)
            else:
                container.clear()
                container.extend(entries)
        with torch.no_grad():
            for tensor, values in self.tensors:
                if tensor.shape != values.shape:
                    tensor.resize_(values.shape)
                tensor.copy_(values)


@dataclass
class _Report:
    missing: list[CheckpointPath] = field(default_factory=list)
    unexpected: list[CheckpointPath] = field(default_factory=list)
    dropped: list[CheckpointPath] = field(default_factory=list)  # read, but the declared class has no field
    defaulted: list[CheckpointPath] = field(default_factory=list)  # a declared class's field the JSON lacks


class CheckedLoad:
    """A load after its check phase: every file it reads and every template it fills passed, nothing changed yet.

    It holds the load's read context (the pinned directory, the checked files) open until `restore()` has
    copied (phase 2) or `close()` is called, so what is copied is what was checked. A multi-rank manager agrees
    with the other ranks between the two phases: no rank copies while another rank's check failed.
    """

    def __init__(
        self,
        loader: CheckpointLoader,
        ctx: CheckpointReadContext,
        plans: list[_Direct | _Reshard],
        report: _Report,
        strict: bool,
    ) -> None:
        self._loader, self._ctx, self._plans, self._report, self._strict = loader, ctx, plans, report, strict
        self._copied = _Copied()

    def restore_unchecked(self) -> None:
        """Phase 2, first part: what the check phase could not check (a custom resharder's own `load`), before the
        engine copies into any template. A multi-rank load agrees on it before `restore`, so a rank whose
        resharder fails leaves every other rank's templates as they were too."""
        with signals_deferred(f"Load of {self._ctx.root}"):
            self._loader._copy(self._ctx, self._plans, self._report, self._strict, self._copied, unchecked_only=True)

    def undo_unchecked(self) -> None:
        """Put back what `restore_unchecked` wrote (another rank's resharder failed, or this rank was interrupted):
        no template changed. A signal arriving meanwhile is handled once they are put back."""
        with signals_deferred(f"Load of {self._ctx.root}", held=_PUT_BACK_HELD):
            self._copied.undo()

    def restore(self) -> dict[str, Any]:
        """Phase 2: copy into the templates, run the resharders; returns the loaded mapping. A signal arriving
        meanwhile is handled once the copy has finished (`signals`): none leaves the templates half restored."""
        with signals_deferred(f"Load of {self._ctx.root}"):
            loaded = self._loader._copy(self._ctx, self._plans, self._report, self._strict, self._copied)
            self._copied.whole = True  # before the block ends: a held signal is handled after this line
            return loaded

    def interrupted(self) -> str:
        """What the templates hold, said of a load that a signal handler's exception left (`interrupted_note`)."""
        if self._copied.whole:
            return (
                "after the copy had finished: every template holds the checkpoint, whole, as a load that returned "
                "leaves it (only what load() returns outside the templates, entries they lack, was lost)"
            )
        if self._copied.engine_started or self._copied.before is not None:  # (custom resharders' not put back)
            return (
                "cut short during the copy, or while the templates were put back (a signal sent again runs its "
                "handler at once): the templates may be partly restored, some entries the checkpoint's, others as "
                "they were. Load again before using them"
            )
        return _UNCHANGED

    @property
    def commit_token(self) -> str | None:
        """Which commit of the id this load pinned (its manifest, hashed): ranks compare it before any copies."""
        return self._ctx.commit_token

    def close(self) -> None:
        self._ctx.close()

    def __enter__(self) -> CheckedLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_UNCHANGED = "before any template was changed: nothing was restored"
_PUT_BACK_HELD = Held(
    "the put-back of the templates as they were before the load",
    "they are put back",
    "the templates may be partly restored",
)


def interrupted_note(exc: BaseException, checkpoint_id: str, checked: list[CheckedLoad]) -> None:
    """Say, on `exc` (a signal handler's KeyboardInterrupt or SystemExit leaving a load), what the caller's
    templates hold: before, the bare KeyboardInterrupt left the caller to guess whether they were untouched or
    restored. `checked`: the load's checked phase, once it passed (empty before).

    Any other exception is told so where the templates changed: a handler may raise anything (SIGALRM's raising
    TimeoutError, a program's bound on the call, is held during the copy too), and such a load raised a bare
    TimeoutError with the templates whole, or partly restored. One that changed nothing says nothing more."""
    where = checked[0].interrupted() if checked else _UNCHANGED
    if not isinstance(exc, Exception):
        add_note(exc, f"Load of {checkpoint_id} was interrupted ({type(exc).__name__}) {where}.")
    elif where != _UNCHANGED:
        add_note(exc, f"Load of {checkpoint_id} raised {type(exc).__name__} {where}.")


class CheckpointLoader:
    def __init__(self, storage: Storage, config: CheckpointLoaderConfig, rank_info: RankInfo) -> None:
        self.storage = storage
        self.config = config
        self.rank_info = rank_info

    def load(
        self,
        checkpoint_id: str,
        items: list[ResolvedItem],
        *,
        map_location: Any = None,
        strict: bool = False,
    ) -> dict[str, Any]:
        """Both phases on this rank alone: `check`, then `CheckedLoad.restore`."""
        with self.check(checkpoint_id, items, map_location=map_location, strict=strict) as checked:
            return checked.restore()

    # ------------------------------------------------------------------ phase 1: check everything

    def check(
        self,
        checkpoint_id: str,
        items: list[ResolvedItem],
        *,
        map_location: Any = None,
        strict: bool = False,
        listed: list[str] | None = None,
    ) -> CheckedLoad:
        """Phase 1: open, verify and decode everything the load reads and dry-run every template; copy nothing.

        `listed`: the item keys the caller read from the checkpoint's manifest (a load without templates); the
        manifest this load pins must list the same, or the id was replaced between the two reads."""
        _check_load_arguments(map_location, strict)
        no_target = sorted(i.key for i in items if i.spec.resharder is not None and i.value is None)
        if no_target:
            raise ConfigError(
                f"Resharding load requires a live target in into= for: {no_target}. Pass the live objects to "
                f"restore into (e.g. into={{'model': model.state_dict()}}); for optimizer state see "
                f"docs/durability.md 'What a load checks'."
            )
        verify = self.config.verify_checksums
        policy = ReadPolicy(
            verify_checksums=verify is not False,
            # Asking for verification where there is nothing to verify against refuses.
            allow_legacy_checkpoints=verify is not True and self.config.allow_legacy_checkpoints,
        )
        ctx = CheckpointReadContext(self.storage, checkpoint_id, policy).__enter__()
        try:
            _check_listed(ctx, listed)
            plans, report = self._check(ctx, items, map_location, strict)
        except BaseException:
            ctx.close()
            raise
        return CheckedLoad(self, ctx, plans, report, strict)

    def _check(
        self, ctx: CheckpointReadContext, items: list[ResolvedItem], map_location: Any, strict: bool
    ) -> tuple[list[_Direct | _Reshard], _Report]:
        for item in items:
            self._check_world_size(ctx.root, item, ctx.manifest)
        metadata = self._distributed_metadata(ctx, items)
        plans: list[_Direct | _Reshard] = []
        for item in items:
            plan = self._plan_item(ctx, item, metadata)
            if plan is not None:
                plans.append(plan)
        _refuse_meta_into_templates(plans, map_location)
        for plan in plans:  # every whole-file check at once: a cold file's decode waits for its own check only
            if isinstance(plan, _Direct):
                ctx.start_whole(plan.rel, f"item '{plan.item.key}'", private=plan.item.value is None)
        with ctx.reading_ahead():  # decoding overlaps the checksums; nothing decoded is used before they pass
            for plan in plans:
                if isinstance(plan, _Direct):
                    plan.value = self._decode(ctx, plan, map_location)
        ctx.wait_verified()
        report = _Report()
        copies: list[_Copy] = []  # every direct item's tensor copies, checked together for shared memory
        containers: dict[int, Any] = {}  # every direct item's template dicts and lists, filled in place
        for plan in plans:
            if isinstance(plan, _Direct):
                self._check_saved_shards(ctx, plan, metadata)
                plan.detached = _Detached() if plan.item.value is not None else None
                _, missing = walk_checkpoint_structure(
                    item_key=plan.item.key,
                    source=plan.value,
                    target=plan.item.value,
                    dry_run=True,
                    adopt=plan.detached.copy if plan.detached is not None else None,
                    unexpected=report.unexpected,
                    copies=copies,
                    containers=containers,
                )
                report.missing.extend(missing)
                report.dropped.extend(CheckpointPath(plan.item.key, p) for p in plan.gaps.ignored)
                report.defaulted.extend(CheckpointPath(plan.item.key, p) for p in plan.gaps.defaulted)
            else:
                report.missing.extend(self._precheck_reshard(ctx, plan))
                report.unexpected.extend(_tensors_not_in_template(plan))
                _check_values_filled_once(plan, containers)
        _check_shared_targets(plans, copies)
        _warn_unchecked_ties(plans, copies)
        if strict:
            _refuse_if_incomplete(ctx.root, report)
        return plans, report

    # ------------------------------------------------------------------ phase 2: copy

    def _copy(
        self,
        ctx: CheckpointReadContext,
        plans: list[_Direct | _Reshard],
        report: _Report,
        strict: bool,
        copied: _Copied | None = None,
        unchecked_only: bool = False,
    ) -> dict[str, Any]:
        copied = copied if copied is not None else _Copied()
        loaded, unhandled = copied.loaded, copied.unhandled
        known = set(report.missing)  # a planned job's unfillable paths were found by the check phase
        # A resharder's own `load` (user code) copies into its template itself, as it reads: the check phase
        # verified every file of its item whole, but a read of any other file, or its own code, can still fail
        # midway. So it runs first, before the engine has copied into any template, and a failure of any puts
        # back every template they wrote into (`_TemplatesBefore`; `_put_back` says so).
        unchecked = [p for p in plans if isinstance(p, _Reshard) and not _engine_runs(p)]
        checked = [p for p in plans if not isinstance(p, _Reshard) or _engine_runs(p)]
        if copied.before is None and any(p.item.key not in loaded for p in unchecked):
            copied.before = _TemplatesBefore.of([p.item.value for p in unchecked])
        for n, plan in enumerate(unchecked if unchecked_only else [*unchecked, *checked]):
            if strict and unhandled and n >= len(unchecked):
                raise _unfilled(ctx.root, unhandled, "no other item was")  # refused before the engine copies
            if plan.item.key in loaded:  # run by `restore_unchecked`
                continue
            copied.engine_started = copied.engine_started or n >= len(unchecked)
            if isinstance(plan, _Direct):
                loaded[plan.item.key], _ = walk_checkpoint_structure(
                    item_key=plan.item.key,
                    source=plan.value,
                    target=plan.item.value,
                    unexpected=[],
                    adopt=plan.detached.made if plan.detached is not None else None,
                )
                continue
            try:
                failed = [CheckpointPath(plan.item.key, tuple(p)) for p in self._reshard(ctx, plan)]
            except BaseException as exc:
                if not _engine_runs(plan):
                    copied.undo()
                    _put_back(ctx.root, plan, [p.item.key for p in unchecked if p.item.key in loaded], exc)
                raise
            unhandled.extend(p for p in failed if p not in known)
            loaded[plan.item.key] = plan.item.value
        if strict and unhandled:
            raise _unfilled(ctx.root, unhandled, "no other item was" if unchecked_only else "so were the other items")
        if unchecked_only:
            return {}
        copied.before = None  # every resharder's `load` ran: nothing to put back, and its copies are let go
        result = {plan.item.key: loaded[plan.item.key] for plan in plans}  # in the items' order
        report.missing.extend(unhandled)
        if report.dropped:
            logger.warning(
                "Checkpoint %s restored partially: %d JSON entr(ies) that the declared JsonSerialization(cls=...) "
                "class has no field for were read and not restored: %s. Declare the class the checkpoint was saved "
                "with, or pass strict=True to refuse such loads.",
                ctx.root,
                len(report.dropped),
                _names(report.dropped),
            )
        if report.defaulted:
            logger.warning(
                "Checkpoint %s restored partially: %d field(s) of the declared JsonSerialization(cls=...) class "
                "not in the checkpoint's JSON took their defaults: %s. Pass strict=True to refuse such loads.",
                ctx.root,
                len(report.defaulted),
                _names(report.defaulted),
            )
        if report.missing or report.unexpected:
            logger.warning(
                "Checkpoint %s restored partially: %d template entr(ies) not in the checkpoint, left as they were "
                "(an entry of a list in a safetensors item comes back as None instead): %s; "
                "%d checkpoint entr(ies) not in the template, returned too (added to its dicts and lists): %s. Pass "
                "strict=True to refuse such loads.",
                ctx.root,
                len(report.missing),
                _names(report.missing),
                len(report.unexpected),
                _names(report.unexpected),
            )
        return result

    def _distributed_metadata(
        self, ctx: CheckpointReadContext, items: list[ResolvedItem]
    ) -> DistributedMetadata | None:
        keys = {i.key for i in items if i.spec.resharder is not None and not i.spec.resharder.skip_resharding}
        if not keys:
            return None
        metadata = read_distributed_metadata(ctx, keys)
        if metadata is not None and ctx.manifest is not None and metadata.world_size != ctx.manifest.world_size:
            raise CorruptCheckpointError(
                f"Checkpoint {ctx.root}: the sharding metadata records world size {metadata.world_size} but the "
                f"manifest {ctx.manifest.world_size}; the checkpoint is damaged or crafted."
            )
        return metadata

    def _check_world_size(self, root: Path, item: ResolvedItem, manifest: Manifest | None) -> None:
        """Refuse default-layout shards across world sizes; explicit `{rank}` layouts read this rank's own copy.

        The default per-rank layout is "what sharded state wants" (the design document), so reading rank r's
        file on another world size would hand back a different shard. An explicit per-rank layout is the
        document's per-rank bookkeeping (misc_state): "each rank directly reads its own copy", if it has one.
        """
        if manifest is None or manifest.world_size == self.rank_info.global_world_size:
            return
        if item.spec.resharder is None and item.is_default_layout and item.key in manifest.keys():  # noqa: SIM118 (a method)
            _refuse_unbacked_world_size(root, manifest, self.rank_info.global_world_size)
            raise TemplateMismatchError(
                f"Item '{item.key}' was saved by {manifest.world_size} rank(s) into per-rank files and is being loaded "
                f"by {self.rank_info.global_world_size}; without a resharder rank {self.rank_info.global_rank} would "
                f"read the wrong shard. Declare ItemSpec(resharder=...) for '{item.key}' (DTensorResharder for "
                f"DTensor state, a custom Resharder otherwise), or load on {manifest.world_size} rank(s)."
            )

    def _plan_item(
        self, ctx: CheckpointReadContext, item: ResolvedItem, metadata: DistributedMetadata | None
    ) -> _Direct | _Reshard | None:
        reshard = self._plan_reshard(ctx, item, metadata)
        if reshard is not None:
            return reshard
        rel = checked_relative_path(item.layout.file_path, f"item '{item.key}'")
        if not ctx.lists(rel):
            held = ctx.manifest is not None and item.key in ctx.manifest.keys()  # noqa: SIM118 (a method)
            own = ctx.manifest.record(item.key, self.rank_info.global_rank) if ctx.manifest is not None else None
            if own is not None:
                # This rank's copy is there, under the path it was saved to: a load with another layout is no
                # rank without a copy, which required=False excuses (it dropped the item silently, even when strict).
                raise TemplateMismatchError(
                    f"Checkpoint {ctx.root} holds item '{item.key}' of rank {self.rank_info.global_rank} in file "
                    f"{own.path!r}, but this load's layout reads {rel!r}. Load with the layout it was saved with "
                    f"(ItemSpec(layout=...)), or load without templates to read each item as its manifest records it."
                )
            if held and item.spec.required:
                raise TemplateMismatchError(
                    f"Checkpoint {ctx.root} holds item '{item.key}' but no file {rel!r} for rank "
                    f"{self.rank_info.global_rank}. Load with the layout it was saved with, or declare "
                    f"ItemSpec(required=False) to accept ranks without a copy."
                )
            if not item.spec.required:
                return None  # the checkpoint does not hold it: excused
            raise MissingItemError(
                f"Checkpoint {ctx.root} has no item '{item.key}' (file {rel!r}); it holds {_held(ctx)}. Fix the "
                f"key, save the item, or declare ItemSpec(required=False) to allow checkpoints without it."
            )
        record = ctx.record(rel)
        if record is not None:  # a format no engine writes, or a newer one's, is said so, never "load with it"
            record.serialization_format(ctx.root / MANIFEST_FILE_NAME)
        if record is not None and record.format.get("type") != type(item.layout.serialization_format).__name__:
            raise TemplateMismatchError(
                f"File {ctx.root / rel} for item '{item.key}' was written as {record.format.get('type')}, but the "
                f"loading config reads it as {type(item.layout.serialization_format).__name__}. Load with the saved "
                f"layout."
            )
        ctx.check(rel, f"item '{item.key}'")
        return _Direct(item, rel)

    def _check_saved_shards(
        self, ctx: CheckpointReadContext, plan: _Direct, metadata: DistributedMetadata | None
    ) -> None:
        """A directly read item's tensors against the shards its sharding metadata records for this rank, before the
        template is compared with them: metadata they do not fit is damage, not a changed model."""
        source = metadata.metadata.get(plan.item.key) if metadata is not None else None
        if source is None or plan.item.value is None:
            return
        from torch_checkpointing.dtensor_resharder import check_saved_shards

        check_saved_shards(ctx.root, plan.item.key, source, self.rank_info.global_rank, plan.value)

    def _plan_reshard(
        self, ctx: CheckpointReadContext, item: ResolvedItem, metadata: DistributedMetadata | None
    ) -> _Reshard | None:
        resharder = item.spec.resharder
        if resharder is None or resharder.skip_resharding or metadata is None:
            return None
        source = metadata.metadata.get(item.key)
        _refuse_partial_targets(item)
        extracted = resharder.extract_sharding_metadata(item.key, item.value)
        check_extracted(type(resharder).__name__, item.key, extracted)  # the load's target, checked as a save's
        target = extracted or None
        if source is None or not resharder.should_reshard(source, target):
            return None
        plan = _Reshard(item, source, target, self._reshard_job(ctx, item, source, target))
        for rel in self._source_files(plan):
            what = f"resharding source of item '{item.key}'"
            ctx.check(rel, what)
            if plan.job is None:
                # A custom resharder's `load` copies into the template as it reads, and nothing says what it will
                # read: every file of the item is checked whole now, with the direct items' files (the check phase
                # waits for them all), so a damaged one raises before the first copy. Its reads then reuse the
                # check (no block is checked twice; on object stores the fetched object is kept for them).
                ctx.start_whole(rel, what)
        return plan

    def _reshard_job(
        self, ctx: CheckpointReadContext, item: ResolvedItem, source: DistributedItemMetadata, target: Any
    ) -> ReshardJob | None:
        """The item's one plan when a DTensorResharder (or a subclass) reshards it, else None."""
        from torch_checkpointing.dtensor_resharder import DTensorResharder, plan_reshard_job

        if not isinstance(item.spec.resharder, DTensorResharder) or target is None:
            return None
        return plan_reshard_job(self.rank_info.global_rank, ctx.root, item.key, target, source, item.value)

    def _source_files(self, plan: _Reshard) -> list[str]:
        """The files a resharder will read: exactly the planned ones for DTensorResharder, else all the item's."""
        ranks = plan.job.source_ranks if plan.job is not None else sorted(plan.source.rank_to_layout_info)
        where = f"sharding metadata of item '{plan.item.key}'"
        layouts = (plan.source.get_layout(r, plan.item.key) for r in ranks)
        return sorted({checked_relative_path(layout.file_path, where) for layout in layouts})

    def _precheck_reshard(self, ctx: CheckpointReadContext, plan: _Reshard) -> list[CheckpointPath]:
        """Phase 1 for a planned job: raise what its copy would raise, its every block checked (and on a store
        fetched) before the first copy; returns the paths it cannot fill (so a strict load refuses first). That
        holds for a subclass with its own `load` too: the checked job is offered to `DTensorResharder.load` when
        that `load` calls it (`offering_checked_job`), so its blocks are not fetched twice; the paths reported are
        then what the `load` returns."""
        from torch_checkpointing.dtensor_resharder import check_reshard_job

        if plan.job is None:
            return []
        failed = [CheckpointPath(plan.item.key, tuple(p)) for p in check_reshard_job(plan.job, _source_view(ctx, plan))]
        return failed if _engine_runs(plan) else []

    def _reshard(self, ctx: CheckpointReadContext, plan: _Reshard) -> list[NestedPath]:
        """Phase 2 for one resharded item: the checked job where it stands in for `load`, else the `load` call."""
        from torch_checkpointing.dtensor_resharder import planned_job_runner

        resharder = plan.item.spec.resharder
        assert resharder is not None
        view = _source_view(ctx, plan)
        runner = planned_job_runner(resharder)
        if runner is not None and plan.job is not None:
            return runner.load_planned(plan.job, view)
        before = _template_tensors(plan.item.value)
        if plan.job is None:
            unfilled = resharder.load(ctx.root, plan.item.key, plan.target, plan.source, plan.item.value, view)
        else:
            from torch_checkpointing.dtensor_resharder import offering_checked_job

            with offering_checked_job(plan.job):
                unfilled = resharder.load(ctx.root, plan.item.key, plan.target, plan.source, plan.item.value, view)
        name = type(resharder).__name__
        checked = _checked_unfilled(name, plan.item.key, unfilled)
        removed = _not_filled_in_place(name, plan.item.key, before, plan.item.value)
        return checked + [path for path in removed if path not in checked]

    def _decode(self, ctx: CheckpointReadContext, plan: _Direct, map_location: Any) -> Any:
        placing = callers_placement(map_location, ctx.root / plan.rel, f"item '{plan.item.key}'")
        watch = _MetaWatch.of(plan, placing)
        value = self._decode_as(ctx, plan, placing if watch is None else watch)
        if watch is not None and watch.sent_to_meta:
            raise _meta_into_templates(map_location, [plan.item.key])
        return value

    def _decode_as(self, ctx: CheckpointReadContext, plan: _Direct, map_location: Any) -> Any:
        item = plan.item
        path = ctx.root / plan.rel
        try:
            return decode(
                item.layout.serialization_format,
                ctx.storage_view(f"item '{item.key}'"),
                path,
                item.key,
                template=item.value,
                map_location=map_location,
                weights_only=self.config.weights_only,
                use_mmap=self.config.use_mmap,
                gaps=plan.gaps,
            )
        except (CheckpointError, ConfigError):
            ctx.check(plan.rel, item.key).verified.result()  # a damaged file explains the failure best
            raise
        except OUT_OF_MEMORY:
            raise  # a full device, not an undecodable file (`codecs.OUT_OF_MEMORY`)
        except _DECODE_ERRORS_OR_OS as exc:
            raise_if_short_of_resources(exc, path, f"item '{item.key}'")
            ctx.check(plan.rel, item.key).verified.result()
            raise undecodable(path, f"item '{item.key}'", exc) from exc

    def close(self) -> None:
        return None


def _check_shared_targets(plans: list[_Direct | _Reshard], copies: list[_Copy]) -> None:
    """Refuse, before the first copy, template tensors that share memory (tied weights, overlapping views)
    and would be filled with different saved values, within an item or across items (`into={"model": sd,
    "ema": sd_sharing_its_tensors}`): the later copy would win, silently. `copies` are the direct items';
    a resharded item's targets join in only where they share storage with another item's (a DTensorResharder
    job checks its own ones), so a load without resharded items pays nothing more than before."""
    jobs = [p.job for p in plans if isinstance(p, _Reshard) and p.job is not None]
    if jobs:
        from torch_checkpointing.dtensor_resharder import shared_target_copies, target_storages

        owners: dict[int, int] = {}  # storage address -> the one owner (-1: the direct items) seen so far
        across: set[int] = set()  # addresses more than one owner uses
        direct = (local_tensor(target).untyped_storage().data_ptr() for _, _, target in copies)
        for owner, addresses in enumerate([direct, *map(target_storages, jobs)], start=-1):
            for address in addresses:
                if owners.setdefault(address, owner) != owner:
                    across.add(address)
        across.discard(0)  # no memory (empty, meta): nothing to share
        if across:
            copies = copies + [copy for job in jobs for copy in shared_target_copies(job, across)]
    check_shared_targets(copies)


def _warn_unchecked_ties(plans: list[_Direct | _Reshard], copies: list[_Copy]) -> None:
    """Name (WARNING), before any copy, template entries sharing memory where one of them is filled by a
    resharder's own `load`: the engine does not see what that `load` writes, so it cannot refuse different
    values as it does for its own copies (the `Resharder` contract states the limit). Silent before: the last
    write won. Costs nothing on a load without such an item."""
    from torch_checkpointing.dtensor_resharder import planned_job_runner

    custom = {
        p.item.key: type(p.item.spec.resharder).__name__
        for p in plans
        if isinstance(p, _Reshard)
        and p.item.spec.resharder is not None
        and planned_job_runner(p.item.spec.resharder) is None
    }
    if not custom:
        return
    targets = [(where, target) for where, _, target in copies]
    for plan in plans:
        if isinstance(plan, _Reshard):
            leaves = iter_leaves(plan.item.value)
            targets.extend((CheckpointPath(plan.item.key, p), t) for p, t in leaves if isinstance(t, torch.Tensor))
    for a, b in overlapping_targets(targets):
        owner = custom.get(a.item_key) or custom.get(b.item_key)
        if owner is not None:
            logger.warning(
                "Template entries '%s' and '%s' share memory (tied weights, or overlapping views), and %s.load fills "
                "them itself: the engine cannot check that it writes the same values into both, and if it does not, "
                "the last write wins. Untie them in the template (e.g. .clone() one) and tie them again after the "
                "load, or check it in the resharder's load.",
                a,
                b,
                owner,
            )


def _check_values_filled_once(plan: _Reshard, containers: dict[int, Any]) -> None:
    """A planned job's tensor-free entries (an optimizer's param_groups) are merged into the template in place,
    as a direct item's are: their template dicts and lists join the load's one check of containers reached at
    two places (`walk_utils`), so one shared with another entry or item must receive the same saved value."""
    from torch_checkpointing.traversal import get_path

    job = plan.job
    if job is None or not job.prepared or not _engine_runs(plan):  # a custom `load` fills it
        return
    for path, saved in job.prepared[0].collected.values:
        target = get_path(job.target, path)
        walk_checkpoint_structure(
            item_key=job.item_key, source=saved, target=target, dry_run=True, at=path, containers=containers
        )


def _source_view(ctx: CheckpointReadContext, plan: _Reshard) -> Storage:
    """The storage a resharder reads its item's files through, its errors naming the item."""
    return ctx.storage_view(f"resharding source of item '{plan.item.key}'")


def _put_back(root: Path, plan: _Reshard, done: list[str], exc: BaseException) -> None:
    """Say (WARNING, and a note on the error) that a resharder's own `load` failed after what the check phase
    checks for it passed (so what failed is a read beyond that, or its own code), and that every template it and
    the resharders before it had written into was put back. The error it raised does not say so itself."""
    name = type(plan.item.spec.resharder).__name__
    checked = "every planned block of the item" if plan.job is not None else "every file of the item"
    before = f" and those of items {done}, which earlier resharders had restored," if done else ""
    said = (
        f"Load of {root}: {name}.load for item '{plan.item.key}' failed ({type(exc).__name__}) after {checked} had "
        f"been verified; the template of '{plan.item.key}'{before} was put back as it was before the load. No "
        f"template was changed."
    )
    logger.warning("%s", said)
    add_note(exc, said)


def _unfilled(root: Path, unhandled: list[CheckpointPath], others: str) -> TemplateMismatchError:
    return TemplateMismatchError(
        f"Checkpoint {root}: the resharder could not fill {[str(p) for p in unhandled]}; the entries it filled were "
        f"restored, {others}."
    )


def _engine_runs(plan: _Reshard) -> bool:
    """Whether the engine runs this resharded item's checked plan itself (a DTensorResharder job), rather than
    a resharder's own `load`."""
    from torch_checkpointing.dtensor_resharder import planned_job_runner

    resharder = plan.item.spec.resharder
    return plan.job is not None and resharder is not None and planned_job_runner(resharder) is not None


class _Detached:
    """The copies of the tensors a load into a template returns as they were decoded (where the template holds
    None, and entries it lacks): decoded from a mapping of the checkpoint's file (`start_whole(private=False)`),
    they were views of it, changed by a later write into the file, SIGBUS once it was truncated.

    The check phase makes them (`copy`), so a tensor that cannot be copied fails the load before any template
    changed; the copy phase returns them (`made`). Only tensors are copied: the containers around them are the
    decode's own new objects, so their tensors are swapped in place (a tuple holding one is rebuilt), by a walk
    without recursion: a crafted safetensors name of 50,000 dots nests that deep, and a recursive copy of it
    raised NestingError where a strict load refuses the entry as unexpected. One memo for the item, so tensors
    the saved state shared (views of one storage) stay shared. A tensor torch cannot deep-copy (a nested tensor:
    `Tensor.__deepcopy__` has no kernel for it) is cloned."""

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}
        self._made: dict[int, Any] = {}  # id of a decoded tensor or tuple -> its copy
        self._kept: list[Any] = []  # the originals, alive while their ids are keys of `_made`

    def copy(self, value: Any) -> Any:
        entered: set[int] = set()
        stack: list[tuple[Any, bool]] = [(value, False)]
        while stack:
            node, children_done = stack.pop()
            if id(node) in self._made or not _holds_children(node):
                self._leaf(node)
                continue
            if children_done:
                self._rebuild(node)
            elif id(node) not in entered:  # a container met again on its own path (a cycle) is left as it is
                entered.add(id(node))
                stack.append((node, True))
                stack.extend((child, False) for child in _children_of(node))
        return self.made(value)

    def made(self, value: Any) -> Any:
        """The copy `copy` made of `value` (a tensor, or a tuple holding one), else `value` itself."""
        return self._made.get(id(value), value)

    def _leaf(self, node: Any) -> None:
        if not isinstance(node, torch.Tensor) or id(node) in self._made:
            return
        try:
            copied = copy.deepcopy(node, self.memo)
        except (RuntimeError, NotImplementedError):
            copied = node.detach().clone()
        self._remember(node, copied)

    def _rebuild(self, node: Any) -> None:
        if isinstance(node, MutableMapping):
            for key, child in list(node.items()):
                node[key] = self.made(child)
        elif isinstance(node, MutableSequence):
            for i, child in enumerate(list(node)):
                node[i] = self.made(child)
        elif isinstance(node, tuple):
            items = [self.made(child) for child in node]
            if any(new is not old for new, old in zip(items, node, strict=True)):
                self._remember(node, type(node)(*items) if hasattr(node, "_fields") else type(node)(items))

    def _remember(self, original: Any, copied: Any) -> None:
        self._made[id(original)] = copied
        self._kept.append(original)


def _holds_children(node: Any) -> bool:
    return isinstance(node, MutableMapping | MutableSequence | tuple)


def _children_of(node: Any) -> list[Any]:
    return list(node.values()) if isinstance(node, Mapping) else list(node)


def _refuse_unbacked_world_size(root: Path, manifest: Manifest, loading: int) -> None:
    """A manifest recording more ranks than this load has, but no file of any rank beyond them: its 'world_size'
    field is what is wrong (one digit damaged, 1 -> 7), not the load. Said before, the item "was saved by 7
    ranks" and the fix offered was to declare a resharder, which would reshard from files that do not exist."""
    ranks = sorted({rec.rank for rec in manifest.files})
    if manifest.world_size <= loading or (ranks and ranks[-1] >= loading):
        return  # a save by fewer ranks, or one whose other ranks' files are there: a real change of world size
    raise CorruptCheckpointError(
        f"Checkpoint {root}: {root / MANIFEST_FILE_NAME} records field 'world_size' = {manifest.world_size}, but "
        f"holds files of rank(s) {ranks[:10]} only (a save by {manifest.world_size} ranks records every rank's "
        f"files): the manifest is damaged or was edited. Load an earlier checkpoint."
    )


def _refuse_partial_targets(item: ResolvedItem) -> None:
    """A DTensorResharder's target metadata refused a Partial DTensor in words for a save: the load says it."""
    from torch_checkpointing.dtensor_metadata import refuse_partial_targets
    from torch_checkpointing.dtensor_resharder import DTensorResharder

    if isinstance(item.spec.resharder, DTensorResharder):
        refuse_partial_targets(item.key, item.value)


def _tensors_not_in_template(plan: _Reshard) -> list[CheckpointPath]:
    """The saved tensors of a planned DTensorResharder job that no template entry receives: dropped silently
    before, even by a strict load (a direct load returns such entries, and `strict=True` refuses them). Those
    under a tensor-free template entry (a fresh optimizer's empty `state`) are already reported unfilled."""
    from torch_checkpointing.dtensor_resharder import planned_job_runner

    job = plan.job
    resharder = plan.item.spec.resharder
    if job is None or resharder is None or planned_job_runner(resharder) is None:
        return []
    return [CheckpointPath(plan.item.key, path) for path in job.not_received]


def _checked_unfilled(resharder: str, key: str, unfilled: object) -> list[NestedPath]:
    """A custom `Resharder.load` result: the nested paths (tuples) it could not fill. A `load` without a `return`
    (None) failed with "'NoneType' object is not iterable", and a str path was split into its characters."""
    if isinstance(unfilled, (list, tuple)) and all(isinstance(p, (tuple, list)) for p in unfilled):
        return [checked_nested_path(p, f"{resharder}.load for item '{key}' returned an entry that") for p in unfilled]
    raise ConfigTypeError(
        f"{resharder}.load for item '{key}' returned {unfilled!r}; it must return the list of nested paths it could "
        f"not fill, each a tuple such as ('layers', 0, 'w') ([] when it filled everything)."
    )


def _template_tensors(template: Any) -> dict[NestedPath, tuple[torch.Tensor, torch.Size]]:
    """Each tensor of a template with its shape, before a resharder's own `load` fills it."""
    return {path: (leaf, leaf.shape) for path, leaf in iter_leaves(template) if isinstance(leaf, torch.Tensor)}


def _not_filled_in_place(
    resharder: str, key: str, before: dict[NestedPath, tuple[torch.Tensor, torch.Size]], template: Any
) -> list[NestedPath]:
    """What a custom `Resharder.load` did to the template's tensors other than fill them in place; returns the
    paths it removed, which count as not filled (`strict=True` refuses them).

    A replaced or resized tensor is logged at WARNING, not refused: the API returns the `into` object itself, so
    the returned mapping holds what the resharder put there (a dataloader's state may legitimately change size),
    but where the template held the caller's own tensors (a model's parameters, `into=model.state_dict()`) those
    were left as they were. Before, all three passed without a word, even with `strict=True`.
    """
    after = dict(iter_leaves(template))
    changed = {path: _how_changed(after.get(path, MISSING), *was) for path, was in before.items()}
    changed = {path: how for path, how in changed.items() if how}
    kept = {str(CheckpointPath(key, path)): how for path, how in changed.items() if how != "removed"}
    if kept:
        log_safely(
            logger,
            logging.WARNING,
            "%s.load for item '%s' did not fill the template's tensors in place: %s. The returned mapping holds "
            "its new objects there, but a caller's tensor that the template held there (a model's parameter) "
            "still holds what it held before the load. A resharder fills each template tensor with "
            "tensor.copy_(saved), and returns the paths it cannot fill.",
            resharder,
            key,
            _first(kept),
        )
    return [path for path, how in changed.items() if how == "removed"]


def _how_changed(now: Any, tensor: torch.Tensor, shape: torch.Size) -> str:
    """How a template entry that held `tensor` of `shape` changed ("" when it was filled in place)."""
    if now is MISSING:
        return "removed"
    if now is not tensor:
        return "replaced"
    return "resized" if tensor.shape != shape else ""


def _first(broken: dict[str, str], limit: int = 10) -> str:
    listed = ", ".join(f"{where!r} {how}" for where, how in list(broken.items())[:limit])
    return f"{listed}{' ...' if len(broken) > limit else ''}"


def _names(paths: list[CheckpointPath], limit: int = 10) -> str:
    names = [str(p) for p in paths[:limit]]
    return f"{names}{' ...' if len(paths) > limit else ''}"


def _refuse_if_incomplete(root: Path, report: _Report) -> None:
    if report.dropped:
        raise TemplateMismatchError(
            f"strict load of {root}: the checkpoint holds JSON entries {_names(report.dropped)} that the declared "
            f"JsonSerialization(cls=...) class has no field for. Nothing was restored. Declare the class the "
            f"checkpoint was saved with, or load with strict=False to drop them (with a warning)."
        )
    missing = report.missing + report.defaulted  # a field that took its default is missing from the checkpoint too
    if missing or report.unexpected:
        raise TemplateMismatchError(
            f"strict load of {root}: missing from the checkpoint {_names(missing)}; in the checkpoint but not "
            f"in the template {_names(report.unexpected)}. Nothing was restored. Fix the template (e.g. for an "
            f"optimizer, initialise its state first), or load with strict=False to restore the overlap."
        )


def _held(ctx: CheckpointReadContext) -> str:
    """The item keys the checkpoint holds, for errors about a key it lacks (a typo, usually)."""
    return str(sorted(ctx.manifest.keys())) if ctx.manifest is not None else "no manifest to list them"


def _check_load_arguments(map_location: Any, strict: object) -> None:
    """Refused at the call: a truthy `strict="no"` would be strict, and a `map_location` torch cannot use failed
    inside the decoder with a bare "'float' object is not callable"."""
    if not isinstance(strict, bool):
        raise ConfigTypeError(f"load(strict=...) must be True or False, got {strict!r}.")
    if isinstance(map_location, (str, torch.device)):
        _check_device(map_location)
        return
    if isinstance(map_location, dict):
        for device in map_location.values():
            if isinstance(device, (str, torch.device)):
                _check_device(device)
        return
    if map_location is None or callable(map_location):
        return
    raise ConfigTypeError(
        f"load(map_location=...) must be None, a str or torch.device ('cpu', 'meta'), a dict of device names or a "
        f"callable, as torch.load takes; got {map_location!r} ({type(map_location).__name__})."
    )


def _refuse_meta_into_templates(plans: list[_Direct | _Reshard], map_location: Any) -> None:
    """A template is filled by copying the decoded tensors into it, so a `map_location` that decodes them onto
    the meta device leaves no values to copy. Refused as the argument it is, before any file is read: the
    check would otherwise meet a meta tensor where a value belongs and report the checkpoint as damaged. (A dict
    or a callable sends only some storages there, known as the file is read: `_MetaWatch`.)"""
    if not isinstance(map_location, (str, torch.device)) or torch.device(map_location).type != "meta":
        return
    keys = sorted(p.item.key for p in plans if isinstance(p, _Direct) and _fills_tensors(p))
    if keys:
        raise _meta_into_templates(map_location, keys)


def _fills_tensors(plan: _Direct) -> bool:
    return any(isinstance(v, torch.Tensor) for v in leaves(plan.item.value))


def _meta_into_templates(map_location: Any, keys: list[str]) -> ConfigError:
    return ConfigError(
        f"load(map_location={map_location!r}) decodes the stored tensors onto the meta device, which has no "
        f"values to copy into the template tensors of items {keys}. Drop map_location (a template is filled on "
        f"its own device), or pass None as an item's template to get its tensors on the meta device."
    )


@dataclass
class _MetaWatch(EnginePlacement):
    """A dict or callable `map_location` as torch.load applies it, noting whether it sent a storage saved off
    the meta device onto it. Which storages it moves is known only as the file is read: {"cuda:0": "meta"}
    leaves a checkpoint saved from the CPU where it is (a load into templates fills them), and a callable may
    send anything there, which the template check then blamed on the checkpoint ("saved from an
    unmaterialised model")."""

    map_location: Any
    sent_to_meta: bool = False

    @staticmethod
    def of(plan: _Direct, map_location: Any) -> _MetaWatch | None:
        """A watch for a Torch item filled into template tensors by a dict or callable; else None."""
        if not isinstance(map_location, dict) and not callable(map_location):
            return None
        if not isinstance(plan.item.layout.serialization_format, TorchSerialization) or not _fills_tensors(plan):
            return None
        return _MetaWatch(map_location)

    def __repr__(self) -> str:  # messages name the caller's argument, not this watch over it
        return repr(self.map_location)

    def __call__(self, storage: Any, location: str) -> Any:
        if isinstance(self.map_location, dict):
            placed = default_restore_location(storage, self.map_location.get(location, location))  # type: ignore[no-untyped-call]
        else:
            placed = self.map_location(storage, location)
        on = getattr(placed, "device", None)
        if isinstance(on, torch.device) and on.type == "meta" and not location.startswith("meta"):
            self.sent_to_meta = True
        return placed


def _check_device(device: str | torch.device) -> None:
    """A device torch cannot name, or one this machine does not have, is the caller's argument, refused here.
    It failed inside torch.load before, which read as a damaged file (`CorruptCheckpointError`): a caller that
    falls back to an earlier checkpoint, or deletes a corrupt one, acted on an intact checkpoint."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"load(map_location={device!r}) names no device torch knows ({exc}); pass e.g. 'cpu', 'cuda:0' or 'meta'."
        ) from None
    if parsed.type in ("cpu", "meta"):
        if parsed.type == "cpu" and parsed.index not in (None, 0):
            raise ConfigError(f"load(map_location={device!r}): the CPU has no device {parsed.index}; pass 'cpu'.")
        return
    module = getattr(torch, parsed.type, None)
    available = getattr(module, "is_available", None)
    if callable(available) and not available():
        raise ConfigError(
            f"load(map_location={device!r}): no {parsed.type} device is available on this machine; pass 'cpu' "
            f"(or map each stored device with a dict, e.g. {{'cuda:0': 'cpu'}})."
        )
    count = getattr(module, "device_count", None)
    if parsed.index is not None and callable(count) and parsed.index >= count():
        raise ConfigError(
            f"load(map_location={device!r}): this machine has {count()} {parsed.type} device(s); pass one of them "
            f"or 'cpu'."
        )


def _check_listed(ctx: CheckpointReadContext, listed: list[str] | None) -> None:
    """A load without templates takes its item list from one read of the manifest and its files from the
    directory it pins: a save replacing the id between the two returned the new checkpoint without the items
    the old one listed (silently), or refused an item "the checkpoint lacks"."""
    if listed is None:
        return
    pinned = sorted(ctx.manifest.keys()) if ctx.manifest is not None else None
    if pinned != sorted(listed):
        raise CorruptCheckpointError(
            f"Checkpoint {ctx.root} was replaced while this load ran (its manifest listed items {sorted(listed)}, "
            f"the checkpoint now open lists {pinned}); nothing was restored. Retry the load."
        )
