"""Retention (which committed checkpoints to keep) and garbage collection (what killed saves left behind).

Deleting is made crash-safe by renaming first: a checkpoint to be deleted is renamed to a trash name
(`.{name}.trash-{pid}-{nonce}`), which no listing counts as a checkpoint, and only then removed. A kill during
the removal therefore leaves a trash directory for the next `gc`, never a half-deleted directory that still
looks committed. Hidden names are cut to fit NAME_MAX (`names`). gc also puts back a checkpoint whose
non-exchange replace was killed between its two renames (nothing at the id, the old copy aside). Every decision
reads manifests only; nothing here touches the writer or the staging code.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import logging
import math
import os
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from torch_checkpointing.asides import copy_to_put_back
from torch_checkpointing.commit import (
    Claim,
    ConditionalStorage,
    TaggedStorage,
    abort_unfinished,
    compares_atomically,
    files_not_listed,
    no_conditional_delete,
    remove_recorded,
    remove_saves_objects,
    stale_reason,
    unfinished_uploads,
    unlisted_files,
    warn_left_in_place,
)
from torch_checkpointing.config import (
    integer_as_int,
    literal_tilde,
    real_as_number,
    refuse_past_a_float,
    wait_seconds,
)
from torch_checkpointing.discovery import (
    CheckpointInfo,
    Leftover,
    OwnerLock,
    PassedOver,
    checkpoint_info,
    default_storage,
    expands_home,
    list_leftovers,
    listing,
    newest_intact,
    require_path,
    require_path_type,
    spelt,
    still_there,
    storage_of,
    unreadable,
    user_path,
    warn_if_a_checkpoint,
)
from torch_checkpointing.errors import (
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    ObjectStoreError,
    raise_if_short_of_resources,
)
from torch_checkpointing.futures import SettledFuture, WorkerPool
from torch_checkpointing.manifest import (
    GC_TOKEN_PREFIX,
    INCOMPLETE_MARKER,
    MANIFEST_FILE_NAME,
    Manifest,
    claim_token,
    our_marker,
    read_bounded,
    read_manifest,
    read_marker,
)
from torch_checkpointing.names import (
    DEFAULT_UNOWNED_AGE_S,
    NAME_MAX,
    aside_of,
    holding,
    host_tag,
    may_be_cut,
    new_nonce,
    step_from_name,
    this_host,
    trash_name,
)
from torch_checkpointing.storage import LOCAL_SCHEMES, local_path_of
from torch_checkpointing.storage.base_storage import Storage, writing_nothing
from torch_checkpointing.storage.filesystem import raise_unless_removed
from torch_checkpointing.storage.fsspec_storage import url_scheme
from torch_checkpointing.waiting import Deadline, Flag

# What a storage raises for a refused or failed request: a filesystem's OSError, an object store's
# ObjectStoreError (a rename there is a copy and a delete, and a refused delete is no OSError).
STORE_ERRORS: tuple[type[Exception], ...] = (OSError, ObjectStoreError)

__all__ = [
    "DEFAULT_UNOWNED_AGE_S",
    "GcReport",
    "PruneReport",
    "RetentionPolicy",
    "RetentionRunner",
    "apply_retention",
    "check_age",
    "collect_garbage",
    "delete_checkpoint",
    "leftovers_report",
    "prune",
    "select_for_deletion",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints under `root` to keep after each commit; every other one is deleted.

    A checkpoint is kept when any rule keeps it: one of the `keep_last` newest; a step that is a multiple of
    `keep_every_n_steps`; one of the `keep_best` by `metric` (`mode` "min" or "max"; checkpoints without the
    metric are never "best"). While no checkpoint under the root records `metric` (a job before its first eval,
    or a misspelt name), the `keep_best` best by each metric they do record are kept in its place, so that a
    misspelt name never deletes the best by the name meant, and the pass is told once (INFO while no checkpoint
    records any metric, else WARNING). The newest committed checkpoint is always kept. With no rule set, nothing
    is deleted. `root` defaults to the parent directory of each saved id. `collect_garbage` also removes the
    temporaries of dead saves; a temporary whose owner cannot be checked (no owner lock on this host) is removed
    only once it is `unowned_after_s` old.
    """

    keep_last: int | None = None
    keep_every_n_steps: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: Literal["min", "max"] = "min"
    root: str | os.PathLike[str] | None = None
    collect_garbage: bool = True
    unowned_after_s: float = DEFAULT_UNOWNED_AGE_S

    def __post_init__(self) -> None:
        """Refuse, where the policy is built, what the retention pass could not use (a wrong type failed later,
        inside the pass, off the training thread)."""
        for name in ("keep_last", "keep_every_n_steps", "keep_best"):
            value = integer_as_int(getattr(self, name))
            object.__setattr__(self, name, value)  # frozen; kept as the plain int a manifest's step is compared with
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigTypeError(f"RetentionPolicy.{name} must be a positive int or None, got {value!r}")
            if value is not None and value < 1:
                raise ConfigError(f"RetentionPolicy.{name} must be a positive int or None, got {value!r}")
        for name, value, cls in (("metric", self.metric, str), ("root", self.root, (str, os.PathLike))):
            if value is not None and not isinstance(value, cls):
                raise ConfigTypeError(f"RetentionPolicy.{name} cannot be {value!r} ({type(value).__name__})")
        if self.root is not None:  # an empty root, or one no path can hold, failed every pass after every save
            require_path(self.root, "RetentionPolicy.root")
            _refuse_url_naming_nothing(os.fspath(self.root))
        if not isinstance(self.collect_garbage, bool):
            raise ConfigTypeError(f"RetentionPolicy.collect_garbage must be a bool, got {self.collect_garbage!r}")
        if self.keep_best is not None and not self.metric:
            raise ConfigError("RetentionPolicy.keep_best needs metric= (the name passed in save(..., metrics={...}))")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"RetentionPolicy.mode must be 'min' or 'max', got {self.mode!r}")
        object.__setattr__(self, "unowned_after_s", check_age(self.unowned_after_s, "RetentionPolicy.unowned_after_s"))

    @property
    def active(self) -> bool:
        """Whether any rule is set (with none, a retention pass deletes nothing)."""
        return any(v is not None for v in (self.keep_last, self.keep_every_n_steps, self.keep_best))


def _refuse_url_naming_nothing(root: str) -> None:
    """A root spelt as a URL that names no directory: a `file://` one naming a host (`file://~/run`) failed every
    pass with the readers' ConfigError, an empty `file://` (`f"file://{ROOT}"`, ROOT unset) pruned each saved
    id's parent instead, and one with nothing after its scheme (`s3://`) names no bucket."""
    scheme = url_scheme(root)
    if scheme in LOCAL_SCHEMES:
        try:
            local_path_of(root)
        except ConfigError as exc:
            raise ConfigError(f"RetentionPolicy.root: {exc}") from None
    folded = _folded_bare_scheme(root)
    if _url_names_nothing(root):
        scheme = scheme or folded
        example = f"{scheme}:///abs/runs" if scheme in LOCAL_SCHEMES else f"{scheme}://bucket/runs"
        folder = f" (a local folder so named is './{root}')" if folded else ""
        raise ConfigError(
            f"RetentionPolicy.root {root!r} names no directory (an unset variable?); name one, e.g. "
            f"{example!r}, or leave root unset for each saved id's parent{folder}."
        )


# `s3://` or `file://` (`f"s3://{BUCKET}"`, BUCKET unset) once `pathlib.Path` folded it: the scheme and its colon
_FOLDED_BARE_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")


def _folded_bare_scheme(text: str) -> str | None:
    """The scheme of `text` where it is a URL `Path` folded to its scheme alone (`Path("s3://")` is `s3:`): no
    URL to `url_scheme`, it was taken as a local folder named `s3:`, and every pass pruned that (none), silently."""
    match = _FOLDED_BARE_URL.fullmatch(text)
    return match.group(1).lower() if match else None


def _url_names_nothing(text: str) -> bool:
    """Whether `text` is a URL with nothing after its scheme and host: `file://` or `file://localhost` (the empty
    path), `s3://` or `s3:/` (no bucket: the one-slash spelling is what `Path` folds a URL into, and a URL to
    every reader), or the scheme alone (`s3:`, `file:`: `Path` folds `s3://` and `file://` so). What
    `f"file://{ROOT}"` is with ROOT unset: an empty path, spelt as a URL."""
    if _folded_bare_scheme(text) is not None:
        return True
    scheme = url_scheme(text)
    if scheme is None:
        return False
    if scheme in LOCAL_SCHEMES:
        return "://" in text and not urllib.parse.urlsplit(text).path
    return not text.split(":", 1)[1].strip("/")


def check_age(value: float, name: str) -> float:
    """An age threshold in seconds: NaN compares false with every age, so it would make every temporary whose
    owner cannot be checked 'old enough' at once; a negative one is a typo for the same."""
    value = real_as_number(name, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a number of seconds >= 0 (inf: never), got {value!r}")
    refuse_past_a_float(name, value)
    if math.isnan(value) or value < 0:
        raise ConfigError(f"{name} must be a number of seconds >= 0 (inf: never), got {value!r}")
    return float(value)


def select_for_deletion(
    checkpoints: list[CheckpointInfo],
    policy: RetentionPolicy,
    *,
    protect: Collection[str | os.PathLike[str]] = (),
    storage: Storage | None = None,
) -> list[CheckpointInfo]:
    """The checkpoints `policy` does not keep, given all committed ones sorted oldest first.

    The checkpoints `protect` names are kept whatever the rules say (`apply_retention` protects the newest
    intact one, which is what `latest_checkpoint` resumes from when the newest one is damaged), however their ids
    are spelt, as `prune` matches them (`storage`: the one the checkpoints are on, None: the one their paths name).
    """
    checkpoints = _checked_checkpoints(checkpoints)
    _check_policy(policy)
    protect = _checked_protect(protect)
    if not policy.active or not checkpoints:
        return []
    return _select(checkpoints, policy, _protected(checkpoints, protect, storage))


def _checked_checkpoints(checkpoints: object) -> list[CheckpointInfo]:
    """`select_for_deletion`'s checkpoints as a list, each refused unless a CheckpointInfo: None was taken as no
    checkpoints, silently; an int, a generator or a list of paths failed inside with a bare TypeError or
    AttributeError ("'str' object has no attribute 'path'")."""
    fix = "pass list_checkpoints(root), the committed checkpoints oldest first"
    if isinstance(checkpoints, (str, bytes, os.PathLike)) or not isinstance(checkpoints, Iterable):
        raise ConfigTypeError(f"checkpoints must be a list of CheckpointInfo, got {checkpoints!r:.80}; {fix}")
    listed = list(checkpoints)
    for entry in listed:
        if not isinstance(entry, CheckpointInfo):
            raise ConfigTypeError(
                f"checkpoints must hold CheckpointInfo only, got {type(entry).__name__} {entry!r:.80}; {fix}"
            )
    return listed


def _check_policy(policy: object) -> None:
    """A policy of another type (None, a dict of its fields) failed inside with a bare AttributeError."""
    if not isinstance(policy, RetentionPolicy):
        raise ConfigTypeError(
            f"policy must be a RetentionPolicy, got {type(policy).__name__} {policy!r:.80}; build one, e.g. "
            f"RetentionPolicy(keep_last=3)"
        )


def _checked_protect(protect: Collection[str | os.PathLike[str]]) -> tuple[str | os.PathLike[str], ...]:
    """`protect` as a tuple of ids, each refused unless it can name a checkpoint: an empty id, or one holding a
    lone surrogate, protected nothing, silently; bytes or an int failed inside with a bare TypeError, as did a
    `protect=None`; and a lone str was taken as its characters, each an id naming nothing."""
    if isinstance(protect, (str, bytes, os.PathLike)):
        raise ConfigTypeError(
            f"protect= takes a collection of checkpoint ids, got the single id {protect!r:.80}: pass [{protect!r:.80}]"
        )
    if not isinstance(protect, Iterable):  # None or an int failed at tuple() with a bare TypeError
        raise ConfigTypeError(
            f"protect= takes a collection of checkpoint ids, got {type(protect).__name__} {protect!r:.80}: pass () "
            f"to protect nothing, or a list of ids"
        )
    ids = tuple(protect)
    for entry in ids:
        require_path_type(entry, "protected id (protect=)")
        if not os.fspath(entry) or _url_names_nothing(os.fspath(entry)):
            raise ConfigError(
                f"an empty protected id (protect=), {os.fspath(entry)!r}, names no checkpoint (an unset variable?)"
            )
    return ids


def _select(checkpoints: list[CheckpointInfo], policy: RetentionPolicy, protected: list[str]) -> list[CheckpointInfo]:
    """`select_for_deletion` with `protected` the listed paths of the protected checkpoints."""
    if not policy.active or not checkpoints:
        return []
    keep = {checkpoints[-1].path, *protected}  # the newest committed one, always
    if policy.keep_last is not None:
        keep.update(c.path for c in checkpoints[-policy.keep_last :])
    if policy.keep_every_n_steps is not None:
        keep.update(c.path for c in checkpoints if c.step is not None and c.step % policy.keep_every_n_steps == 0)
    keep.update(c.path for c in _kept_as_best(checkpoints, policy))
    return [c for c in checkpoints if c.path not in keep]


def _protected(
    checkpoints: list[CheckpointInfo], protect: Collection[str | os.PathLike[str]], storage: Storage | None
) -> list[str]:
    """The listed paths of the checkpoints `protect` names. Compared as written, a protected id spelt `~/run/a`,
    relative to the working directory or with a trailing `/` matched no listed path, and its checkpoint was
    selected for deletion."""
    if not protect:
        return []
    store = storage_of(checkpoints[0].path, storage, "checkpoint path")
    kept = {_identity(store, p) for p in protect}
    return [c.path for c in checkpoints if _identity(store, c.path) in kept]


def _kept_as_best(checkpoints: list[CheckpointInfo], policy: RetentionPolicy) -> list[CheckpointInfo]:
    """What `keep_best` keeps: the best by `metric`, or, while no checkpoint records it, the best by each metric
    they do record.

    Refusing the pass instead (the guard against a misspelt `lsos` deleting the best by `loss`) also refused it
    to a job recording its metric only at evals, before the first: keep_last was never applied and the disk
    filled. Keeping every checkpoint that records some metric would fill it as well where a train loss is
    recorded at every save. The name meant is one they record, if any checkpoint can be best by it, so its best
    is kept; and a checkpoint that falls out of the best by a name never comes back into it.
    """
    if policy.keep_best is None or policy.metric is None:
        return []
    recorded = _recorded_metrics(checkpoints)
    names = [policy.metric] if policy.metric in recorded else recorded
    return [c for name in names for c in _best(checkpoints, name, policy.mode, policy.keep_best)]


def _recorded_metrics(checkpoints: list[CheckpointInfo]) -> list[str]:
    """The metric names the checkpoints record, sorted."""
    return sorted({name for c in checkpoints for name in (c.metrics or {})})


def _best(checkpoints: list[CheckpointInfo], metric: str, mode: str, n: int) -> list[CheckpointInfo]:
    scored = [
        (value, i, c)
        for i, c in enumerate(checkpoints)
        if c.metrics is not None and (value := c.metrics.get(metric)) is not None and not math.isnan(value)
    ]
    # Ties go to the newer checkpoint.
    scored.sort(key=lambda t: (t[0] if mode == "min" else -t[0], -t[1]))
    return [c for _, _, c in scored[:n]]


def _shown(path: str | os.PathLike[str]) -> str:
    """A path as messages name it: an object store's id as its URL (`Path` folds `s3://b/k` into `s3:/b/k`, which
    neither `aws s3` nor this library's CLI takes back); `spelt`, the one place that puts a scheme back."""
    return spelt(path)


def _trash_name(path: Path) -> Path:
    return path.with_name(trash_name(path.name, os.getpid(), new_nonce(), host_tag()))


def delete_checkpoint(
    path: str | os.PathLike[str], storage: Storage | None = None, *, expected: CheckpointInfo | None = None
) -> bool:
    """Rename `path` to a trash name, then remove it. Returns False (and logs a WARNING) when it failed.

    With `expected`, the checkpoint is deleted only if it is still that one (same commit time): a save that
    re-used the id and committed since the listing must not be deleted in its place. One that another process
    (a second retention pass, an operator's `prune`) deleted meanwhile is no failure: False, at INFO.
    """
    storage = storage_of(path, storage, "path")
    return _delete(Path(user_path(path, storage)), storage, expected).done


@dataclass(frozen=True)
class _Outcome:
    """What one deletion (or one gc step: a removal, a move back) did: `done`, or not, and then `failure` says
    why what was to go is still there (None when another process deleted, re-saved or collected it first: not
    a failure, and not ours to count). Reports carry the failure, so that no caller has to read the log."""

    done: bool
    failure: str | None = None
    superseded: bool = False  # a move back not done because a save committed the id meanwhile: collect the copy


def _delete(src: Path, storage: Storage, expected: CheckpointInfo | None) -> _Outcome:
    if expected is not None and not _still(storage, src, expected):
        logger.info("Retention left %s alone: it was re-saved or deleted since it was listed", _shown(src))
        return _Outcome(False)
    try:
        foreign = files_not_listed(storage, src)
    except STORE_ERRORS as exc:
        return _not_deleted(storage, src, f"its files could not be listed: {exc}")
    if foreign:  # what save() refuses to replace, retention refuses to delete
        if _gone(storage, src):  # its manifest vanished with it: nothing there is foreign, nothing is left
            return _not_deleted(storage, src, "")
        why = _foreign_files(foreign)
        _say_kept_for_foreign_files(src, why)
        return _Outcome(False, why)
    trash = _trash_name(src)
    with holding(trash):  # gc in this process must not take it for a killed process's of the same pid
        return _delete_through(trash, src, storage, expected)


def _chosen(storage: Storage, src: Path, expected: CheckpointInfo | None) -> CheckpointInfo | None:
    """The checkpoint a deletion means to delete: `expected`, or (for a caller that named none) the one at `src`
    as the deletion starts; None when that cannot be told."""
    if expected is not None:
        return expected
    try:
        return checkpoint_info(src, storage)
    except STORE_ERRORS:
        return None


# The checkpoints already named in this process as kept for files not theirs, with why: retention runs after
# every save, and a user's file stays until the user moves it, so the same WARNING came again at every pass.
_KEPT_FOR_FOREIGN_FILES: set[tuple[str, str]] = set()


def _say_kept_for_foreign_files(src: Path, why: str) -> None:
    """At WARNING the first time in this process (and whenever the files named change), at DEBUG after."""
    said = (_shown(src), why)
    level = logging.DEBUG if said in _KEPT_FOR_FOREIGN_FILES else logging.WARNING
    _KEPT_FOR_FOREIGN_FILES.add(said)
    logger.log(level, "Retention left checkpoint %s alone: %s.", *said)


def _delete_through(trash: Path, src: Path, storage: Storage, expected: CheckpointInfo | None) -> _Outcome:
    """Rename `src` to `trash`, check it once more, remove it (or put it back)."""
    chosen = _chosen(storage, src, expected)
    try:
        storage.rename(src, trash, is_directory=True)
    except STORE_ERRORS as exc:
        return _rename_failed(storage, src, trash, f"rename failed: {exc}{_refusal_fix(exc)}", chosen)
    if expected is not None and not _still(storage, trash, expected):
        return _put_back(storage, trash, src)
    if late := _written_since_the_check(storage, trash):
        # a file written into it between the check above and the rename (an eval job's eval.json) is not ours
        why = _foreign_files(late)
        unmoved = _move_back(storage, trash, src)
        logger.warning("Retention left checkpoint %s alone: %s.", _shown(src), unmoved or why)
        return _Outcome(False, unmoved or why)
    _sync_parent(storage, src)
    _remove(
        storage, trash, f"checkpoint {_shown(src)}"
    )  # it is no checkpoint any more either way; gc retries a failure
    return _Outcome(True)


def _rename_failed(storage: Storage, src: Path, trash: Path, why: str, chosen: CheckpointInfo | None) -> _Outcome:
    """A rename that failed midway: on a store without rename, a copy to `trash`, then a delete of `src` that
    did not finish. A partial copy goes. A whole copy goes only while `src` is whole too; when `src` lost files
    (the store did the delete and its answer was lost), the copy is the only whole one left, perhaps of a save
    that re-used the id after the check: it is put back under `src`, and the deletion reported as failed.
    A whole copy of the very checkpoint this deletion chose (`chosen`) also goes when another process deleted
    `src` (nothing is left there) or holds it (its delete, or a save of the id, is under way): that process's
    work, not a lost answer of this one's, is why `src` is not whole. A `src` that holds another checkpoint than
    the chosen one (a re-save, which the store's rename refuses to delete) is left alone, at INFO, no failure.

    Before, the copy went whatever `src` held: the report said "could not delete", and the checkpoint (or a
    re-save the policy never chose) was gone. Then, of two passes deleting one checkpoint at once, the one whose
    delete came second put back what the other had deleted (or left its copy in the trash, to be renamed back
    by hand)."""
    try:
        copy = checkpoint_info(trash, storage)
        copy_whole = copy is not None
        copied = copy_whole or still_there(storage, trash)
        now = checkpoint_info(src, storage)
        src_whole = now is not None
    except STORE_ERRORS as exc:
        why += (
            f"; a copy of it may be left at {_shown(trash)} ({exc}): if {_shown(src)} holds no checkpoint, "
            f"rename it back"
        )
        logger.warning("Retention could not delete checkpoint %s (%s)", _shown(src), why)
        return _Outcome(False, why)
    if copy is not None and not src_whole:
        if _deleted_elsewhere(storage, src, copy, chosen):
            return _drop_copy_of_deleted(storage, trash, src)
        return _put_whole_copy_back(storage, trash, src, why)
    if copied:
        _remove(storage, trash, f"the copy of {_shown(src)} its failed delete left")
    if now is not None and chosen is not None and now.commit_time != chosen.commit_time:
        logger.info("Retention left %s alone: it was re-saved while being deleted", _shown(src))
        return _Outcome(False)  # a save the policy never chose, which the store's delete left whole
    if src_whole or _gone(storage, src):  # as it was, or deleted by another process meanwhile (said at INFO)
        return _not_deleted(storage, src, why)
    why += (
        f"; it is no checkpoint any more (its files are gone, its {INCOMPLETE_MARKER} marker is left): "
        f"`torch-checkpointing gc {_shown(src.parent)}` removes the rest"
    )
    logger.warning("Retention could not delete checkpoint %s whole (%s)", _shown(src), why)
    return _Outcome(False, why)


def _deleted_elsewhere(storage: Storage, src: Path, copy: CheckpointInfo, chosen: CheckpointInfo | None) -> bool:
    """Whether the whole `copy` is of the checkpoint chosen for deletion, and another process deleted `src` (it
    is gone, or holds no file: a directory store's folder that delete emptied stays until its last step) or is
    at work there (a live claim holds it). Before, an emptied folder at `src` counted as a checkpoint that lost
    its files: the copy was put back, the checkpoint the other process deleted listed and loaded again."""
    if chosen is None or copy.commit_time != chosen.commit_time:
        return False  # a re-save of the id the policy never chose, or nothing tells: put back
    return _gone(storage, src) or _emptied(storage, src) or bool(_claimed_by_a_save(storage, src))


def _emptied(storage: Storage, path: Path) -> bool:
    """Whether `path` holds no file at all (folders only, or none: not even a marker or a manifest, which a
    delete of this process's own, its answer lost, leaves); False where that cannot be told."""
    folders = [path]
    try:
        while folders:
            folder = folders.pop()
            for name in storage.ls(folder):
                if not storage.isdir(folder / name) or storage.is_link(folder / name):
                    return False
                folders.append(folder / name)
    except FileNotFoundError:
        return True
    except STORE_ERRORS:
        return False
    return True


def _drop_copy_of_deleted(storage: Storage, trash: Path, src: Path) -> _Outcome:
    """Remove this deletion's copy of a checkpoint another process deleted meanwhile: not done by this pass,
    and no failure (the goal is met), said at INFO; a copy that cannot be removed is a failure, for gc."""
    removed = _remove(storage, trash, f"the copy of {_shown(src)} another process deleted meanwhile")
    if removed.failure is not None:
        return removed
    logger.info("Retention found %s deleted (or being deleted) by another process meanwhile", _shown(src))
    return _Outcome(False)


def _put_whole_copy_back(storage: Storage, trash: Path, src: Path, why: str) -> _Outcome:
    """Move the only whole copy back under `src`, unless another save holds `src` now (its claim is not ours
    to overwrite): then the copy stays where it is, and the report says where."""
    held = _claimed_by_a_save(storage, src)
    unmoved = (
        f"{_shown(src)} is held by {held}; the checkpoint is left whole at {_shown(trash)}: rename it back by hand "
        f"once that save is done with the id"
        if held
        else _move_back(storage, trash, src)
    )
    why += f"; {unmoved}" if unmoved else f"; its files were put back whole under {_shown(src)}"
    logger.warning("Retention could not delete checkpoint %s (%s)", _shown(src), why)
    return _Outcome(False, why)


def _claimed_by_a_save(storage: Storage, path: Path) -> str:
    """The live claim the `.incomplete` marker at `path` holds ('' when none: absent, empty, or dead, as the
    claim of the failed delete itself is once it is over)."""
    try:
        marker = read_marker(storage, path / INCOMPLETE_MARKER)
    except FileNotFoundError:  # none is no claim, on a local disk too (`read_local_regular`)
        return ""
    except (OSError, CheckpointError):
        return "a marker that cannot be read"
    claim = Claim.parse(marker)
    return "" if claim is None or _dead_reason(marker) is not None else claim.describe()


def _written_since_the_check(storage: Storage, trash: Path) -> list[str]:
    """Files not listed by its manifest, asked again once the rename took the checkpoint out of every writer's
    path (a writer can no longer open a new file there by the checkpoint's name)."""
    try:
        return files_not_listed(storage, trash)
    except STORE_ERRORS as exc:  # it was listable a moment ago: its removal reports what fails
        logger.warning("Retention could not list %s again after renaming it (%s); removing it", _shown(trash), exc)
        return []


def _foreign_files(foreign: list[str]) -> str:
    shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
    return (
        f"it also holds files that are not part of it ({shown}); deleting it would delete them. Move them out, "
        f"or delete the directory yourself"
    )


def _put_back(storage: Storage, trash: Path, src: Path) -> _Outcome:
    """Lost a race with a commit that swapped a new checkpoint in between the check and the rename."""
    unmoved = _move_back(storage, trash, src)
    if unmoved:
        logger.warning("Retention could not put back a checkpoint re-saved while it was deleted: %s", unmoved)
        return _Outcome(False, f"a re-saved {unmoved}")
    logger.info("Retention left %s alone: it was re-saved while being deleted", _shown(src))
    return _Outcome(False)


def _move_back(storage: Storage, trash: Path, src: Path) -> str:
    """Rename `trash` back to `src`; '' when done, else what failed and the fix.

    On a store without rename, a move back whose copy finished and whose delete of `trash` failed is done: `src`
    holds that very checkpoint again, and the copy left in the trash goes (before, the report said "could not
    be moved back: rename it back by hand" of a checkpoint that was back, and the trash kept a second copy).
    A move back refused because a save committed `src` meanwhile is done too: the copy is older than what the
    id holds, and goes (a person told to rename it back would put an older checkpoint over a newer one)."""
    try:
        storage.rename(trash, src, is_directory=True)
    except STORE_ERRORS as exc:
        if _moved_back_already(storage, trash, src):
            _remove(storage, trash, f"the copy of {_shown(src)} moved back")
            return ""
        if _committed(storage, src):  # a save committed the id meanwhile: the copy is older, garbage now
            return _superseded_copy(storage, trash, src, exc)
        return f"{_shown(src)} was moved to {_shown(trash)} and could not be moved back ({exc}): rename it back by hand"
    return ""


def _superseded_copy(storage: Storage, trash: Path, src: Path, exc: Exception) -> str:
    """A move back refused because a save committed `src` meanwhile: the copy goes, unless it holds files that
    are not part of it (a late eval.json, the very reason it was being moved back): then it stays, and what to
    do is the failure. Before, it went whatever it held: the user's file was deleted at INFO, in no report."""
    logger.info("Retention did not move %s back: %s was saved again meanwhile (%s)", _shown(trash), _shown(src), exc)
    try:
        foreign = files_not_listed(storage, trash)
    except STORE_ERRORS as err:
        foreign = [f"(its files could not be listed: {err})"]
    if not foreign:
        _remove(storage, trash, f"the copy of {_shown(src)} that a new save of it replaced")
        return ""
    shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
    return (
        f"{_shown(src)} was saved again while it was deleted; its older copy at {_shown(trash)} was kept, as it "
        f"holds files that are not part of it ({shown}): move them out, then delete {_shown(trash)}"
    )


def _moved_back_already(storage: Storage, copy: Path, path: Path) -> bool:
    """Whether a move of `copy` back to `path` that raised got the checkpoint there: `path` holds a committed
    checkpoint and `copy` is no whole copy of another one (its manifest went first in its delete, or it is the
    same checkpoint). False when that cannot be told."""
    try:
        here, there = checkpoint_info(path, storage), checkpoint_info(copy, storage)
    except STORE_ERRORS:
        return False
    return here is not None and (there is None or here.commit_time == there.commit_time)


def _gone(storage: Storage, path: Path) -> bool:
    """Whether nothing is at `path` any more (not even a dangling link)."""
    return not still_there(storage, path)


def _not_deleted(storage: Storage, src: Path, why: str) -> _Outcome:
    """Not deleted, logged: at INFO when another process deleted `src` first (the goal is met), else at WARNING."""
    if _gone(storage, src):
        logger.info("Retention found %s already gone: another process deleted it meanwhile", _shown(src))
        return _Outcome(False)
    logger.warning("Retention could not delete checkpoint %s (%s); it is left as it was", _shown(src), why)
    return _Outcome(False, why or "it could not be deleted")


def _still(storage: Storage, path: Path, expected: CheckpointInfo) -> bool:
    current = checkpoint_info(path, storage)  # a Path's `~` is a folder of that name (`config.home_expanded`)
    return current is not None and current.commit_time == expected.commit_time


def _sync_parent(storage: Storage, path: Path) -> None:
    with contextlib.suppress(*STORE_ERRORS):  # durability of the rename only; it is already not a checkpoint
        storage.sync_directory(path.parent)


def _remove(storage: Storage, path: Path, what: str) -> _Outcome:
    """Remove a trash or leftover directory; a local store removes its manifest and marker last (see
    `LocalFileSystemStorage.rmdir`), so a removal killed midway leaves a directory gc still recognises.

    Not done and no failure when another process (a second gc) removed it first."""
    try:
        storage.rmdir(path)
    except STORE_ERRORS as exc:
        if _gone(storage, path):
            logger.info("%s at %s was removed by another process meanwhile", what, _shown(path))
            return _Outcome(False)
        failed = _gc_failed(f"could not remove {what} at {_shown(path)} ({exc}); {_removal_next_step(exc)}")
        if (left := _TRASH_LEFT.get()) is not None:
            left.append((_shown(path), failed.failure or ""))
        return failed
    logger.info("Deleted %s (%s)", what, _shown(path))
    return _Outcome(True)


# What lifts a refusal that every retry of a removal meets again; a retry said "will retry" and failed the same way.
_REMOVAL_FIXES = {
    errno.EACCES: "this user may not remove it: run gc as the owner of the folder the error names, or change "
    "that folder's owner or mode",
    errno.EPERM: "the filesystem refused it: check the attributes of the file the error names (`lsattr`: "
    "immutable or append-only) and clear them (`chattr -i`)",
    errno.EROFS: "its filesystem is read-only: remount it read-write",
}


def _removal_fix(exc: BaseException) -> str | None:
    """What lifts the OS's refusal `exc` (`_REMOVAL_FIXES`), None for any other failure."""
    return _REMOVAL_FIXES.get(exc.errno) if isinstance(exc, OSError) and exc.errno is not None else None


def _removal_next_step(exc: BaseException) -> str:
    """What to do after a failed removal: the fix where the OS refused it (each gc meets that again until someone
    lifts it), else that gc will try again (a store outage, a shortage passes)."""
    fix = _removal_fix(exc)
    if fix is None:
        return "`torch-checkpointing gc` will retry"
    return f"{fix}, then run `torch-checkpointing gc` again"


def _refusal_fix(exc: BaseException) -> str:
    """`; FIX` for a rename (the first step of every removal) that the OS refused, which each later gc or prune
    meets again until someone lifts it ("Read-only file system" alone named no way out); "" for any other."""
    fix = _removal_fix(exc)
    return "" if fix is None else f"; {fix}"


def _gc_failed(why: str) -> _Outcome:
    """A step of gc that failed: logged at WARNING, and its reason kept for the report."""
    logger.warning("gc: %s", why)
    return _Outcome(False, why)


def as_local_id(storage: Storage, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """A `file://` URL on the local filesystem as the path it names, as the manager reads a `file://` id (the
    readers refuse the URL there). A policy root spelt as the ids failed every retention pass, and a checkpoint
    protected by its id matched no listed path and was deleted. One naming another host (`file://~/run`: the host
    `~`) is the ConfigError the readers give it: kept as a URL, a protected id so spelt protected nothing."""
    if url_scheme(path) not in LOCAL_SCHEMES or not expands_home(storage):
        return path  # as it came: a Path's `~` is a folder of that name
    return local_path_of(os.fspath(path))


def _identity(storage: Storage, path: str | os.PathLike[str]) -> str:
    """One name per checkpoint however it is spelt: a save's id (relative to the working directory or to an
    object store's `url` root, or a full URL) and the path a listing under the policy's `root` gives for it.
    Compared as written, a root spelt otherwise than the ids protected nothing, and the pass after a save
    deleted that save's checkpoint. A local `~` is the home directory, as a save's id: `protect=["~/run/step_1"]`
    named a folder '~' under the working directory, and the checkpoint it meant was deleted."""
    path = as_local_id(storage, path)  # outside the try: another host's file:// id is refused, not taken as written
    try:
        local = storage.local_path(Path(user_path(path, storage)))
        return os.path.realpath(local) if local is not None else storage.remap_path(Path(path)).rstrip("/")
    except (ValueError, OSError):  # a name this store does not resolve: as written
        return os.path.normpath(os.fspath(path))


def _metric_not_recorded(
    root: str | os.PathLike[str], policy: RetentionPolicy, found: list[CheckpointInfo]
) -> tuple[int, str] | None:
    """The level and text to tell a pass whose `keep_best` metric no checkpoint under `root` records (what
    `_kept_as_best` keeps instead); None when one does. INFO while they record no metric at all (a job before
    its first eval: nothing can be best by any name, so nothing is at risk); WARNING while they record others
    (a misspelt name, or a metric recorded at evals only beside others recorded at every save)."""
    if policy.keep_best is None or policy.metric is None or not found:
        return None
    recorded = _recorded_metrics(found)
    metric, n = policy.metric, policy.keep_best
    if metric in recorded:
        return None
    if not recorded:
        return logging.INFO, (
            f"keep_best by metric {metric!r}: no checkpoint under {_shown(root)} records any metrics yet, so none "
            f"is kept as best until a save passes metrics={{{metric!r}: value}}; the other rules apply meanwhile"
        )
    return logging.WARNING, (
        f"keep_best by metric {metric!r}: no checkpoint under {_shown(root)} records it (they record "
        f"{', '.join(map(repr, recorded))}), so retention keeps the best {n} by each of those instead, and applies "
        f"the other rules. If {metric!r} is recorded only at some saves (an eval), this lasts until the first; "
        f"else fix the metric name (RetentionPolicy(metric=...), prune --metric) or pass "
        f"save(..., metrics={{{metric!r}: value}})"
    )


def _note(root: str | os.PathLike[str], policy: RetentionPolicy, found: list[CheckpointInfo]) -> str | None:
    """`_metric_not_recorded`'s text alone, for a pass whose caller shows it itself."""
    said = _metric_not_recorded(root, policy, found)
    return None if said is None else said[1]


def _tell_metric_not_recorded(
    root: str | os.PathLike[str],
    policy: RetentionPolicy,
    found: list[CheckpointInfo],
    told: set[tuple[str, int]] | None,
) -> str | None:
    """Log `_metric_not_recorded`'s text, once per root and level among the passes sharing `told` (a job's
    passes: one a save); returns the text."""
    said = _metric_not_recorded(root, policy, found)
    if said is None:
        return None
    level, text = said
    key = (_shown(root), level)
    if told is None or key not in told:
        logger.log(level, "%s", text)
        if told is not None:
            told.add(key)
    return text


def apply_retention(
    root: str | os.PathLike[str],
    policy: RetentionPolicy,
    storage: Storage | None = None,
    *,
    dry_run: bool = False,
    protect: Collection[str | os.PathLike[str]] = (),
) -> list[CheckpointInfo]:
    """Delete the committed checkpoints under `root` that `policy` does not keep (never one in `protect`);
    returns those (to be) deleted."""
    return prune(root, policy, storage, dry_run=dry_run, protect=protect).deleted


@dataclass
class PruneReport:
    """What a retention pass did: the checkpoints (to be) deleted, and those the policy does not keep that are
    still there, each with why (foreign files inside, a failed rename), so that `prune` can exit non-zero."""

    deleted: list[CheckpointInfo] = field(default_factory=list)
    failed: list[tuple[CheckpointInfo, str]] = field(default_factory=list)
    # None, or why keep_best kept the best by the metrics recorded instead of by its own (no checkpoint records it)
    metric_not_recorded: str | None = None
    # The entries under the root the policy could not weigh, left as they are: a damaged manifest, a newer
    # engine's, or one this user may not read (`PassedOver.unreadable` tells damage apart). Only logged before,
    # so a script reading the report never learned of them.
    not_listed: list[PassedOver] = field(default_factory=list)
    # The trash folders left where a removal failed after its rename (path, why: the fix where the OS refused
    # it): the checkpoint is deleted, its files are not. Only logged before, and the CLI exited 0.
    trash_left: list[tuple[str, str]] = field(default_factory=list)


def prune(
    root: str | os.PathLike[str],
    policy: RetentionPolicy,
    storage: Storage | None = None,
    *,
    dry_run: bool = False,
    protect: Collection[str | os.PathLike[str]] = (),
    log_note: bool = True,
) -> PruneReport:
    """`apply_retention`, reporting the deletions that failed as well as those done.

    `log_note=False` is for a caller that shows `PruneReport.metric_not_recorded` itself (the CLI's text
    output): logged as well, its WARNING reached the operator twice, on stderr and beside the deletions."""
    with writing_nothing() if dry_run else contextlib.nullcontext():
        return _prune(root, policy, storage, dry_run=dry_run, protect=protect, told=None, log_note=log_note)


def _prune(
    root: str | os.PathLike[str],
    policy: RetentionPolicy,
    storage: Storage | None,
    *,
    dry_run: bool,
    protect: Collection[str | os.PathLike[str]],
    told: set[tuple[str, int]] | None,
    log_note: bool = True,
) -> PruneReport:
    """`prune`; `told` is what the passes sharing it were already told (see `_tell_metric_not_recorded`), None
    to tell every time; `log_note=False` to tell nothing (the caller shows the report's note)."""
    require_path(root)
    _check_policy(policy)
    protect = _checked_protect(protect)
    storage = storage_of(root, storage)
    root = user_path(root, storage)
    listed = listing(root, storage)
    found = listed.checkpoints
    note = _tell_metric_not_recorded(root, policy, found, told) if log_note else _note(root, policy, found)
    protected = _protected(found, protect, storage) if found else []
    doomed = _select(found, policy, protected)
    if doomed:
        resume = newest_intact(found, storage)  # only worth its stats when something is to be deleted
        doomed = _select(found, policy, protected + ([] if resume is None else [resume.path]))
    if dry_run:
        report = _dry_run(doomed, storage)
        report.metric_not_recorded, report.not_listed = note, listed.unlisted
        return report
    report = PruneReport(metric_not_recorded=note, not_listed=listed.unlisted)
    with _noting_trash_left() as report.trash_left:
        for c in doomed:
            if _stopped():
                break
            outcome = _delete(Path(c.path), storage, c)
            if outcome.done:
                report.deleted.append(c)
            elif outcome.failure is not None:
                report.failed.append((c, outcome.failure))
    return report


# Set on a RetentionRunner's pass: close() sets it when it stops waiting for the pass, which then ends at its next
# safe point (before its next deletion, removal or move back), instead of deleting on after close() returned.
_STOP: contextvars.ContextVar[Flag | None] = contextvars.ContextVar("retention_stop", default=None)


def _stopped() -> bool:
    stop = _STOP.get()
    return stop is not None and stop.is_set()


# The trash folders a prune's removals left, collected for its report while `_noting_trash_left` runs: the
# deletions that leave one (a rename done, its removal refused) are many steps down, and each dropped the failure.
_TRASH_LEFT: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar("trash_left", default=None)


@contextlib.contextmanager
def _noting_trash_left() -> Iterator[list[tuple[str, str]]]:
    """The list every removal that fails in this block adds (its path, why) to."""
    left: list[tuple[str, str]] = []
    token = _TRASH_LEFT.set(left)
    try:
        yield left
    finally:
        _TRASH_LEFT.reset(token)


def _dry_run(doomed: list[CheckpointInfo], storage: Storage) -> PruneReport:
    """What a pass would do: a checkpoint holding files it does not list would be left, as the pass leaves it."""
    report = PruneReport()
    for c in doomed:
        try:
            foreign = files_not_listed(storage, Path(c.path))
        except STORE_ERRORS as exc:
            if not _gone(storage, Path(c.path)):  # else deleted by another process meanwhile: nothing to do
                report.failed.append((c, f"its files could not be listed: {exc}"))
            continue
        if foreign:
            report.failed.append((c, _foreign_files(foreign)))
        else:
            report.deleted.append(c)
    return report


@dataclass
class GcReport:
    """What a garbage collection found: removed, kept (with why), failed."""

    removed: list[Leftover] = field(default_factory=list)
    kept: list[tuple[Leftover, str]] = field(default_factory=list)
    failed: list[tuple[Leftover, str]] = field(default_factory=list)  # with why: what a script must not dig out of logs


def _dead_claim(storage: Storage, path: Path) -> str | None:
    """Why the save (or delete) that left `.incomplete` at a final name of an object store has certainly ended.

    The rule a save uses before it takes such an id over (`commit.stale_reason`): a marker without a claim (an
    earlier version's save, or a delete that failed midway), a claim whose process is gone on this host, or one
    older than any save. A claim that may be live is never collected.
    """
    try:
        marker = read_marker(storage, path / INCOMPLETE_MARKER)
    except OSError as exc:
        raise_if_short_of_resources(exc, path / INCOMPLETE_MARKER, "the check whether its claim is dead")
        return None
    except ObjectStoreError:  # no answer about the claim: told where the caller reports it
        raise
    except CheckpointError:  # a file larger than any marker is not ours, either
        return None
    return _dead_reason(marker)


def _not_told_apart(storage: Storage, path: Path) -> str | None:
    """Why the dead save's prefix at `path` is left whole: its marker records none of the files the save wrote
    (empty, or an earlier version's claim), and it holds files no manifest of ours lists, which may be a user's.
    None where what is ours is told apart (records, tags: `_collect_saves_objects`; a killed gc's claim over a
    save whose names it recorded) or all of it is ours.

    Before, gc removed such a prefix whole on an object store: a user's `notes.txt` beside an empty marker was
    deleted; on a local disk it was kept, said at INFO as "may still be writing it", naming no file.

    A claim of gc or of a delete that records nothing (`_records_nothing`) is judged as an empty marker is:
    before, every gc claim counted as told apart, and a file a user put into a prefix whose gc or delete had
    been killed was deleted with it. Where the store lists which save wrote each object (S3's tags), the
    objects a save of ours wrote are told apart from the rest."""
    try:
        claim = Claim.parse(read_marker(storage, path / INCOMPLETE_MARKER))
        if claim is not None and _records_nothing(claim):
            claim = None
        if claim is not None and (claim.records or claim.is_gc()):
            return None
        others = unlisted_files(storage, path, claim)
        if others and claim is not None and _tagged(storage, claim, path):
            return None
        if others and claim is None:
            others = _not_saved_by_us(storage, path, others)
    except FileNotFoundError:
        return None  # removed meanwhile: the collection says so
    except (OSError, ObjectStoreError, CheckpointError) as exc:
        if isinstance(exc, OSError):
            raise_if_short_of_resources(exc, path, "the check that a dead save's files are told apart from a user's")
        return f"what it holds could not be told apart from a user's files ({exc}); left as it is"
    if not others:
        return None
    shown = ", ".join(others[:_SHOWN_FILES]) + (" ..." if len(others) > _SHOWN_FILES else "")
    return (
        f"its {INCOMPLETE_MARKER} records none of the files its save wrote, and it holds files no manifest of ours "
        f"lists ({shown}): they may be yours, so nothing in it is removed. Move yours out and run gc again, or "
        f"delete {_shown(path)} by hand if all of it is garbage"
    )


def _records_nothing(claim: Claim) -> bool:
    """Whether `claim` is gc's or a delete's (or a move's) that records none of the files under it: a move's, an
    earlier version's delete's (a delete's claim now names the manifest it removes last, which lists its files:
    `fsspec_storage._live_claim`), and a killed gc's over an earlier version's save, which it collected whole.
    Whoever made it judged what was there then, not what a user put there after it was killed."""
    return claim.is_gc() and not claim.records


def _not_saved_by_us(storage: Storage, path: Path, names: list[str]) -> list[str]:
    """Of `names` under `path`, those no save of ours wrote, where the store lists that (S3's tags); else all."""
    by_save = storage.objects_by_save(path) if isinstance(storage, TaggedStorage) else None
    return names if by_save is None else [name for name in names if name not in by_save[0]]


_SHOWN_FILES = 5


def _tagged(storage: Storage, claim: Claim, path: Path) -> bool:
    """Whether the claim's save tagged its uploads and the store lists, under `path`, which save wrote each object
    (`objects_by_save`: None off S3). Before, a tagged claim read where no such listing comes (on `file://`)
    counted as told apart, and gc collected its prefix whole, a user's file with it. Asked only where files
    nothing else tells apart are there: on S3 it costs a HEAD per object."""
    return claim.tags and isinstance(storage, TaggedStorage) and storage.objects_by_save(path) is not None


def _dead_reason(marker: bytes) -> str | None:
    if not our_marker(marker):
        return None  # another program's file: nothing of ours, never collected
    me = Claim(token="", uid="", host=this_host(), pid=os.getpid(), created=time.time())
    return stale_reason(Claim.parse(marker), me)


# Why gc keeps a leftover that goes on its own (a live save's, a young one: a later pass collects it), or that it
# moved back (said at WARNING as it did): no person need act, so the pass after each commit tells them at INFO.
_OWNER_ALIVE = "its owner is alive"
_CLAIM_MAY_BE_LIVE = "a save's claim beside a committed checkpoint; that save may be live (it lets go on its own)"
_MAY_STILL_BE_WRITTEN = (
    "incomplete checkpoint at its final name (a store without atomic rename may still be writing it)"
)
_REMOVED_MEANWHILE = "removed by another process while gc looked at it"
_YOUNG = "owner unknown on this host and only "
_MOVED_BACK = " under its id"


def _passes_on_its_own(why: str) -> bool:
    return why.startswith((_OWNER_ALIVE, _CLAIM_MAY_BE_LIVE, _MAY_STILL_BE_WRITTEN, _REMOVED_MEANWHILE, _YOUNG)) or (
        why.endswith(_MOVED_BACK)
    )


# What `_tell_kept` compares a reason by: its numbers (an age, `(12s old)`) change from one pass to the next.
_NUMBER = re.compile(r"\d+")


def _tell_kept(report: GcReport, told: set[tuple[str, str]]) -> None:
    """Log what a pass's gc kept, with why: at WARNING the first time `told` sees a leftover kept for a reason a
    person must act on (delete it by hand, rename it back, let gc read it), else at INFO. Before, the pass after
    each commit dropped gc's report: such a leftover showed only in the `gc` command, and stayed for good.

    A reason is told by its words, not its numbers: `unowned_after_s=inf` keeps a leftover "(12s old), kept for
    good", and taken whole, the age that grows between passes made it a new WARNING at every save."""
    for leftover, why in report.kept:
        said = (leftover.path, _NUMBER.sub("#", why))
        level = logging.INFO if _passes_on_its_own(why) or said in told else logging.WARNING
        told.add(said)
        logger.log(level, "Retention's gc kept %s %s: %s", leftover.kind, _shown(leftover.path), why)


def _why_keep(
    leftover: Leftover,
    root: Path,
    storage: Storage,
    unowned_after_s: float,
    now: Callable[[], float],
    put_back: Collection[str] = (),
) -> str | None:
    """None when `leftover` is garbage; else the reason to keep it. `now`: the time by the store's clock, which
    stamped what `_last_changed` reads (`Storage.store_now`). `put_back`: the ids this pass moves a copy
    back under (a dry run only says it would, so the id still holds nothing: its other copies are garbage all the
    same, as the real run finds them)."""
    if leftover.newer_engine:
        return (
            f"a newer engine's committed checkpoint beside an {INCOMPLETE_MARKER} marker: what that means is the "
            f"newer engine's to tell (run its gc), so it is left as it is"
        )
    if not leftover.recognised and (closed := unreadable(storage, Path(leftover.path))):
        return closed  # not "holds nothing of ours": nobody can tell what it holds
    if not leftover.recognised and leftover.kind == "incomplete":
        return (
            f"its {INCOMPLETE_MARKER} is not a marker of ours (another program's file, e.g. a download's "
            f"progress): not removed (delete it by hand if it is garbage)"
        )
    if not leftover.recognised:
        return (
            f"named like a {leftover.kind} directory of ours but holds no {MANIFEST_FILE_NAME} or {INCOMPLETE_MARKER} "
            f"of ours: not removed (delete it by hand if it is garbage)"
        )
    if leftover.kind == "claim":
        if _dead_claim(storage, Path(leftover.path)) is None:
            return _CLAIM_MAY_BE_LIVE
        return None
    if leftover.kind == "incomplete":
        dead = _dead_claim(storage, Path(leftover.path))
        if dead is not None and (mixed := _not_told_apart(storage, Path(leftover.path))):
            return mixed
        if dead is None or storage.atomic_rename:
            return _MAY_STILL_BE_WRITTEN
        logger.info("gc: %s is an unfinished save or delete whose claim is dead (%s)", _shown(leftover.path), dead)
        return None
    if leftover.owner_alive:
        return _OWNER_ALIVE
    if leftover.kind == "replaced":
        target = _replaced_id(leftover, root, storage, put_back)
        if target is None:
            return (
                f"the only copy of a checkpoint whose id starts with {leftover.checkpoint_name!r} (its name was cut "
                f"to fit {NAME_MAX} bytes and nothing is at the id): rename it back to its id by hand"
            )
        if target not in put_back and not _committed(storage, root / target):
            return f"the only copy of {target} (no committed checkpoint replaced it)"
    if leftover.owner_alive is None:
        try:
            changed = _last_changed(storage, leftover)
        except FileNotFoundError:
            return _REMOVED_MEANWHILE
        except STORE_ERRORS as exc:
            return f"owner unknown on this host, and its age could not be told ({exc})"
        if changed is None:
            return (
                "owner unknown on this host, and its age could not be told (the store gives no modification time "
                "that can be read for every object in it): kept for good; run gc on the host that wrote it, or "
                "delete it by hand once no save writes it"
            )
        age = now() - changed
        if math.isinf(unowned_after_s):  # `--older-than inf`: "< infs" named no number of seconds
            return (
                f"owner unknown on this host ({age:.0f}s old), kept for good: the age threshold is never reached "
                f"(--older-than inf, unowned_after_s=inf); pass a number of seconds, or run gc where the save ran"
            )
        if age < unowned_after_s:
            return f"{_YOUNG}{age:.0f}s old (< {unowned_after_s:.0f}s)"
    return _users_files_in_trash(storage, leftover)


def _users_files_in_trash(storage: Storage, leftover: Leftover) -> str | None:
    """Why a trash copy of a committed checkpoint stays: files in it that are not part of it (what retention keeps
    a copy for, telling the user to move them out: `_superseded_copy`). Before, gc removed every dead owner's trash
    whole, and the next job's gc deleted the user's file all the same. None for any other leftover."""
    path = Path(leftover.path)
    if leftover.kind != "trash" or not _committed(storage, path):  # no manifest: nothing tells its files apart
        return None
    try:
        foreign = files_not_listed(storage, path)
    except STORE_ERRORS as exc:
        return f"what it holds could not be listed ({exc}): it may hold files that are not part of it"
    return _foreign_files(foreign) if foreign else None


def _last_changed(storage: Storage, leftover: Leftover) -> float | None:
    """When a leftover whose owner cannot be checked last changed (by the store's clock; None where it cannot
    tell: kept, and said so, where "0s old" before promised a collection that never came). A temporary is made
    by mkdir and written into: the newest mtime in it (`_written_at`). A trash or aside copy gets its name by a
    rename, which leaves the mtime of when it was written (days ago, for a checkpoint that retention deletes):
    when it got its name (`Storage.changed_at`). Before, gc removed another host's trash made a moment ago,
    under the retention still checking it."""
    path = Path(leftover.path)
    local = storage.local_path(path)
    if leftover.kind == "temporary" and local is not None:
        return _written_at(local)
    return storage.changed_at(path)


def _written_at(local: str) -> float:
    """The newest mtime of the directory `local` and of everything below it (FileNotFoundError when it is gone).

    A directory's own mtime moves when an entry is made in it, not when a file in it is written: a save on
    another node writing one large file (or files in a rank's directory) for longer than `unowned_after_s` read
    as that old, and gc removed its temporary under it. What cannot be looked at (a directory this user may not
    list) raises: passed over in silence, the newest file could be in it, and gc removed a live save's files."""
    newest = os.lstat(local).st_mtime
    for where, dirs, files in os.walk(local, onerror=raise_unless_removed):
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                newest = max(newest, os.lstat(os.path.join(where, name)).st_mtime)
    return newest


def _replaced_id(leftover: Leftover, root: Path, storage: Storage, put_back: Collection[str]) -> str | None:
    """The id a replaced copy was moved aside from; None when its name was cut and no sibling (nor an id a copy
    goes back under in this pass) matches it.

    Two long ids that differ past the cut (a run's long name, then the step) make the same cut names: a sibling
    whose name ends in a step other than the one the copy records is another id, not the one it was cut from.
    Taken for it, the copy a replace of `..._1` killed between its renames left (`..._1` holding nothing) was
    removed as a replaced copy of the committed `..._2`: the only copy of `..._1` lost.
    """
    name = Path(leftover.path).name
    if not may_be_cut(name):
        return leftover.checkpoint_name
    step = _recorded_step(storage, Path(leftover.path))
    ids = [s for s in [*storage.ls(root), *put_back] if step is None or step_from_name(s) in (None, step)]
    return aside_of(name, ids)


def _recorded_step(storage: Storage, path: Path) -> int | None:
    """The step the manifest at `path` records; None when it records none or cannot be read."""
    try:
        manifest = read_manifest(storage, path)
    except OSError as exc:  # short of descriptors, any id of the name's start was the copy's, the wrong one too
        raise_if_short_of_resources(exc, path / MANIFEST_FILE_NAME, "the step of a copy moved aside")
        return None
    except ObjectStoreError:  # no answer about the step: with none, any id of the name's start would do
        raise
    except CheckpointError:
        return None
    return manifest.step if manifest is not None else None


def _to_put_back(
    leftovers: list[Leftover], root: Path, storage: Storage, unowned_after_s: float
) -> dict[Path, tuple[str, int]]:
    """The copies aside to move back under their ids (path: the id, and how many copies of it are aside), chosen
    by the rule a dead writer's trainer uses (`asides.copy_to_put_back`): a replace killed between its two
    renames (the fallback of a store without an atomic exchange) leaves nothing at the id and the old checkpoint
    aside, and a load of the id finds nothing.

    A copy whose name was cut does not tell gc its id, which holds nothing: such an id is left to the user.
    """
    ids = {lo.checkpoint_name for lo in leftovers if lo.kind == "replaced" and not may_be_cut(Path(lo.path).name)}
    chosen: dict[Path, tuple[str, int]] = {}
    for name in sorted(ids):
        try:
            choice = copy_to_put_back(storage, root / name, unowned_after_s=unowned_after_s)
        except STORE_ERRORS as exc:
            logger.warning(
                "gc could not look at the copies of %s aside (%s); left as they are", _shown(root / name), exc
            )
            continue
        if choice.chosen is not None:
            chosen[choice.chosen] = (name, len(choice.copies))
    return chosen


def _restore(storage: Storage, leftover: Leftover, target: Path) -> _Outcome:
    """Done once moved back; neither done nor failed when another gc moved it back (or away) first, or holds the
    id while it does (on a store without rename, a move is a copy under a claim at `target`, then a delete).

    Before, a move that lost to another gc's claim on an object store was reported failed, "rename it by hand",
    while the other gc moved the copy back."""
    path = Path(leftover.path)
    try:
        storage.rename(path, target, is_directory=True)
    except STORE_ERRORS as exc:
        if _gone(storage, path):
            logger.info("gc found %s already moved by another process (to %s, or away)", _shown(path), _shown(target))
            return _Outcome(False)
        holder = _claimed_by_a_save(storage, target)
        if holder or _moved_back_already(storage, path, target):
            where = f"{_shown(target)} is held by {holder}" if holder else f"it is back at {_shown(target)}"
            logger.info("gc left %s to another process: %s (%s)", _shown(path), where, exc)
            return _Outcome(False)
        if _committed(storage, target):
            logger.info(
                "gc did not move %s back: a save committed %s meanwhile, so the copy is garbage (%s)",
                _shown(path),
                _shown(target),
                exc,
            )
            return _Outcome(False, superseded=True)
        return _gc_failed(f"could not move {_shown(leftover.path)} back to {_shown(target)} ({exc}); rename it by hand")
    _sync_parent(storage, target)
    logger.warning(
        "Restored checkpoint %s from %s: the save that replaced it was killed between its two renames, so the id "
        "held nothing (the unfinished save's temporary, if any, is garbage)",
        _shown(target),
        _shown(leftover.path),
    )
    return _Outcome(True)


def _committed(storage: Storage, path: Path) -> bool:
    """Whether `path` holds a committed checkpoint of ours (a directory, not a link, with a readable manifest):
    only then is a copy moved aside for it garbage; an empty folder or a link at the name replaces nothing."""
    local = storage.local_path(path)
    if local is not None and os.path.islink(local):
        return False
    return checkpoint_info(path, storage) is not None


def collect_garbage(
    root: str | os.PathLike[str],
    storage: Storage | None = None,
    *,
    dry_run: bool = False,
    unowned_after_s: float = DEFAULT_UNOWNED_AGE_S,
) -> GcReport:
    """Remove what dead saves, replacements and deletions left under `root`; never a live writer's temporary.
    `dry_run`: only say what would go, writing nothing (not even a probe of the store's clock: `writing_nothing`).

    A root that is a file is a `NotADirectoryError`, and a checkpoint passed for its run's root is warned about,
    naming the parent: "nothing to collect" there hid the run's leftovers."""
    check_age(unowned_after_s, "unowned_after_s")
    require_path(root)
    storage = storage_of(root, storage)
    root = user_path(root, storage)
    report = leftovers_report(root, storage, dry_run=dry_run, unowned_after_s=unowned_after_s)
    if not (report.removed or report.kept or report.failed):
        warn_if_a_checkpoint(Path(root), storage)
    return report


def leftovers_report(
    root: str | os.PathLike[str], storage: Storage | None, *, dry_run: bool, unowned_after_s: float
) -> GcReport:
    """`collect_garbage`, for a caller whose listing of `root` already warned about a checkpoint root (`ls`)."""
    check_age(unowned_after_s, "unowned_after_s")
    require_path(root)
    storage = storage_of(root, storage)
    with writing_nothing() if dry_run else contextlib.nullcontext():
        return _collect_garbage(Path(user_path(root, storage)), storage, dry_run, unowned_after_s)


def _collect_garbage(base: Path, storage: Storage, dry_run: bool, unowned_after_s: float) -> GcReport:
    """`collect_garbage` of the root `base`."""

    def now() -> float:  # read only where an age is judged: most passes judge none, and a probe writes
        return storage.store_now(base)

    report = GcReport()
    leftovers = list_leftovers(base, storage)
    put_back = _to_put_back(leftovers, base, storage, unowned_after_s)
    restored: set[str] = set()
    superseded: list[Leftover] = []  # copies chosen to go back whose id a save committed meanwhile: garbage now
    for leftover in [lo for lo in leftovers if Path(lo.path) in put_back]:  # first: the other copies are garbage then
        if _stopped():
            return report
        restore_to, copies = put_back[Path(leftover.path)]
        done = _Outcome(True) if dry_run else _restore(storage, leftover, base / restore_to)
        if done.done:
            restored.add(restore_to)
            which = f"the only copy of {restore_to}" if copies == 1 else f"the copy of {restore_to} committed last"
            verb = "to be moved back" if dry_run else "moved back"
            report.kept.append((leftover, f"{which}, {verb}{_MOVED_BACK}"))
        elif done.failure is not None:
            report.failed.append((leftover, done.failure))
        elif done.superseded:
            superseded.append(leftover)
    for leftover in [*[lo for lo in leftovers if Path(lo.path) not in put_back], *superseded]:
        if _stopped():
            return report
        why = _why_keep(leftover, base, storage, unowned_after_s, now, restored)
        if why is not None:
            report.kept.append((leftover, why))
            continue
        removed = _Outcome(True) if dry_run else _collect(storage, leftover)
        if removed.done:
            report.removed.append(leftover)
        elif removed.failure is not None:
            report.failed.append((leftover, removed.failure))
    return report


def _collect(storage: Storage, leftover: Leftover) -> _Outcome:
    """Done once removed; neither done nor failed when another process (a second gc) removed it first; else the
    failure (also warned)."""
    path = Path(leftover.path)
    if leftover.kind == "trash":
        return _remove(storage, path, f"trash of {leftover.checkpoint_name}")
    if leftover.kind == "claim":
        return _let_go_of_stray_claim(storage, path)
    if leftover.kind == "probe":
        return _remove_probe(storage, path)
    if leftover.kind == "incomplete":
        if (removed := _collect_saves_objects(storage, path)) is not None:
            return removed
        with _held_whole(storage, path) as (refused, uploads):  # an earlier version's claim: it goes whole
            if refused is not None:
                return refused
            done = _move_and_remove(storage, leftover, path)
            if done.done and uploads:  # the move's own abort passes them over: gc's claim over them is live
                abort_unfinished(storage, path, uploads, f"gc of the unfinished save at {_shown(path)}")
            return done
    return _move_and_remove(storage, leftover, path)


_Held = tuple[_Outcome | None, list[tuple[str, str]]]


@contextlib.contextmanager
def _held_whole(storage: Storage, path: Path) -> Iterator[_Held]:
    """Hold the id `path`, whose dead claim (an earlier version's: it names neither tags nor records) gc judged,
    with gc's own claim for as long as its prefix is moved and removed whole; yields (None, the unfinished
    uploads listed under the dead claim, for the caller to abort) then, or (why not, []): the claim changed
    since it was judged (a save took the id over). Stores without a conditional replace, and a prefix without a
    marker, are collected unheld, as before (the move aborts the uploads itself).

    Before, a save that took the dead claim over between gc's judgement and its move lost its claim and every
    file it had uploaded to the move, went on, and committed a manifest whose files were gone."""
    marker = path / INCOMPLETE_MARKER
    if not isinstance(storage, ConditionalStorage) or not compares_atomically(storage, marker):
        yield None, []
        return
    try:
        found = storage.read_object(marker)
        uploads = unfinished_uploads(storage, path)  # under the dead claim: none of a save that takes the id after
    except STORE_ERRORS as exc:
        yield (
            _gc_failed(f"could not read the claim of the unfinished save at {_shown(path)} ({exc}); left as it is"),
            [],
        )
        return
    if found is None:
        yield None, []
        return
    if _dead_reason(found[0]) is None:
        yield _taken_over_meanwhile(storage, path), []
        return
    dead = Claim.parse(found[0]) or Claim(token="", uid="", host="", pid=0, created=0.0)
    with _gc_pass() as uid:
        try:
            held = _hold_for_gc(storage, marker, found[1], dead, uid, records=False)
        except STORE_ERRORS as exc:
            yield _gc_failed(f"could not hold the unfinished save at {_shown(path)} ({exc}); left as it is"), []
            return
        yield (None, uploads) if held is not None else (_taken_over_meanwhile(storage, path), [])


def _move_and_remove(storage: Storage, leftover: Leftover, path: Path) -> _Outcome:
    """Move a leftover to a trash name, then remove that (a removal killed midway leaves a trash gc knows)."""
    trash = _trash_name(path.with_name(leftover.checkpoint_name))
    with holding(trash):
        try:
            storage.rename(path, trash, is_directory=True)
        except STORE_ERRORS as exc:
            if _gone(storage, path):
                logger.info("gc found %s already removed by another process", _shown(path))
                return _Outcome(False)
            return _gc_failed(f"could not move {_shown(path)} aside ({exc}); left as it was{_refusal_fix(exc)}")
        return _remove(storage, trash, f"{leftover.kind} directory of {leftover.checkpoint_name}")


def _remove_probe(storage: Storage, path: Path) -> _Outcome:
    """Delete a dead process's clock probe (an empty file or object: `discovery._probe_leftover`)."""
    try:
        storage.delete(path)
    except FileNotFoundError:
        logger.info("gc found the clock probe %s already removed by another process", _shown(path))
        return _Outcome(False)
    except STORE_ERRORS as exc:
        if _gone(storage, path):
            logger.info("gc found the clock probe %s already removed by another process", _shown(path))
            return _Outcome(False)
        return _gc_failed(f"could not delete the clock probe {_shown(path)} ({exc}); left as it was")
    logger.info("Deleted the clock probe %s, left by a process killed while it read the store's clock", _shown(path))
    return _Outcome(True)


def _collect_saves_objects(storage: Storage, path: Path) -> _Outcome | None:
    """A dead save's prefix on a store that records which save wrote each object: only objects saves of ours
    wrote go (each only if unchanged since seen), then the claim (only if still the one judged dead), and what
    is left (a user's PUT while the save ran, or over one of its keys) is named at WARNING. On a store without
    such a record the save's ranks named their files in records beside the claim (`commit.remove_recorded`):
    only those go. None where the claim has neither (an earlier version's): the prefix is collected whole, as
    before.

    Every tagged object goes, not only the dead claim's: the saves whose claims it took over are as dead. A save
    taking the id over meanwhile fails its commit on a file gone, and keeps its claim (the delete is conditional).
    Recorded names have no such version: gc first holds the id with its own claim (`_hold_for_gc`), so no save
    takes it over while the names gc listed are deleted.
    """
    if not isinstance(storage, ConditionalStorage):
        return None
    marker = path / INCOMPLETE_MARKER
    try:
        found = storage.read_object(marker)
        held = Claim.parse(found[0]) if found is not None else None
        if found is None or held is None or _dead_reason(found[0]) is None:
            return None
        uploads = unfinished_uploads(storage, path)  # under the dead claim: none of a save that takes the id after
        if held.records:
            if not compares_atomically(storage, marker):
                return _cannot_take_claim(storage, path, marker, "unfinished save")
            with _gc_pass() as uid:
                etag = _hold_for_gc(storage, marker, found[1], held, uid)
                if etag is None:
                    return _taken_over_meanwhile(storage, path)
                found = (found[0], etag)
                changed, others = [], remove_recorded(storage, path, _dead_saves_manifest(storage, path, held))
                _let_go_of(storage, path, found[1], uploads)
        elif held.tags and isinstance(storage, TaggedStorage):
            by_save = storage.objects_by_save(path)
            if by_save is None:
                return None
            ours, others = by_save
            changed = remove_saves_objects(storage, path, ours)
        else:
            return None
        if not held.records:
            _let_go_of(storage, path, found[1], uploads)
    except STORE_ERRORS as exc:
        return _gc_failed(f"could not remove the unfinished save at {_shown(path)} ({exc}); left as it is")
    url = storage.remap_path(path)
    warn_left_in_place(url, [*others, *changed], f"gc of the unfinished save at {url}")
    logger.info("gc removed the unfinished save at %s (its claim is dead)", _shown(path))
    return _Outcome(True)


def _let_go_of(storage: ConditionalStorage, path: Path, etag: str, uploads: list[tuple[str, str]]) -> None:
    """The dead save's claim goes (only if still the version judged), then the uploads listed under it."""
    if storage.delete_object(path / INCOMPLETE_MARKER, etag):
        abort_unfinished(storage, path, uploads, f"gc of the unfinished save at {_shown(path)}")


@contextlib.contextmanager
def _gc_pass() -> Iterator[str]:
    """An owner lock of one gc collection for as long as it runs; its uid, for gc's claim to name ('' where the
    lock could not be taken: the claim is then judged by its pid and age, as before).

    Before, gc's claim named no lock: a collection that failed midway left it, and while its process lived on
    (a trainer whose retention runs gc) it stayed live to every judge on the host for 24 h, refusing saves of
    the id and keeping the prefix from later gc passes."""
    lock = OwnerLock(f"gc{uuid.uuid4().hex}")
    try:
        yield lock.uid if lock.held else ""
    finally:
        lock.release()


def _cannot_take_claim(storage: Storage, path: Path, marker: Path, what: str) -> _Outcome:
    """gc leaves a dead claim on a store that cannot delete it conditionally (`commit.no_conditional_delete`)."""
    why = no_conditional_delete(storage.remap_path(path), storage.remap_path(marker))
    return _gc_failed(f"left the {what} at {_shown(path)}: {why}")


def _hold_for_gc(
    storage: ConditionalStorage, marker: Path, etag: str, dead: Claim, uid: str, *, records: bool = True
) -> str | None:
    """Replace the dead claim `dead` (only if still the version `etag`) with gc's own; the version of gc's claim,
    or None when the marker changed meanwhile (a save of the id took it over: its files are not gc's to delete).
    `records=False` where gc collects the prefix whole: a gc killed while it held the id leaves a claim the next
    gc collects whole too, never one that only lets the recorded names go (an earlier version's save has none)."""
    mine = dataclasses.replace(Claim.for_gc(dead, uid), records=records)
    if not storage.replace_object(marker, mine.to_bytes(), etag):
        return None
    found = storage.read_object(marker)
    held = Claim.parse(found[0]) if found is not None else None
    return found[1] if found is not None and held is not None and held.token == mine.token else None


def _taken_over_meanwhile(storage: Storage, path: Path) -> _Outcome:
    """The claim gc judged dead changed before gc held it: a save took the id over (a failure: left as it is),
    or another gc pass holds it, or moved it away already (two passes at once: a job's retention beside
    `torch-checkpointing gc`, two cron jobs). That one collects it: neither done nor failed here. Before, the
    second pass reported it failed, "a save of that id took it over", and the CLI exited 1."""
    if _gone(storage, path) or _held_by_gc(storage, path / INCOMPLETE_MARKER):
        logger.info("gc left the unfinished save at %s to another gc pass, which holds or removed it", _shown(path))
        return _Outcome(False)
    return _gc_failed(
        f"left the unfinished save at {_shown(path)}: its claim changed after gc judged it dead (a save of that id "
        f"took it over), so what is there is that save's now"
    )


def _held_by_gc(storage: Storage, marker: Path) -> bool:
    """Whether the `.incomplete` marker at `marker` is a gc pass's claim (`commit.Claim.for_gc`)."""
    try:
        found = storage.read_object(marker) if isinstance(storage, ConditionalStorage) else None
    except STORE_ERRORS:
        return False
    token = claim_token(found[0]) if found is not None else None
    return token is not None and token.startswith(GC_TOKEN_PREFIX)


def _dead_saves_manifest(storage: Storage, path: Path, held: Claim) -> Manifest | None:
    """The manifest of the dead save `held`: the save died after writing it and before removing its marker,
    perhaps with its records gone already, so the files it lists are its own. `remove_recorded` deletes it after
    those files (it was deleted here, first: a gc killed before the files went left them unlisted for good).
    None when there is none, or it is another save's (left in place)."""
    try:
        manifest = Manifest.from_json(read_bounded(storage, path / MANIFEST_FILE_NAME))
    except FileNotFoundError:
        return None
    except ObjectStoreError:  # no answer about whose manifest it is: left unread, its save's files were "not ours"
        raise
    except (CheckpointError, ValueError, KeyError, UnicodeDecodeError):
        return None  # not a manifest of ours: named as left in place
    if not held.owns(manifest):  # a killed gc's claim `held` owns the manifest of the save it collected
        return None
    return manifest


def _let_go_of_stray_claim(storage: Storage, path: Path) -> _Outcome:
    """Remove a dead save's claim from beside the committed checkpoint at `path`, only if it is still the
    claim judged dead (a conditional delete); the checkpoint itself is not touched."""
    marker = path / INCOMPLETE_MARKER
    if not isinstance(storage, ConditionalStorage):
        return _gc_failed(f"cannot remove the claim {_shown(marker)} conditionally on this store; left as it is")
    if not compares_atomically(storage, marker):
        return _cannot_take_claim(storage, path, marker, "stopped save's claim")
    try:
        found = storage.read_object(marker)
        if found is None:
            return _Outcome(False)  # let go of meanwhile
        if _dead_reason(found[0]) is None or not storage.delete_object(marker, found[1]):
            return _gc_failed(f"left the claim {_shown(marker)}: it changed since it was judged dead")
    except STORE_ERRORS as exc:
        return _gc_failed(f"could not remove the claim {_shown(marker)} ({exc}); left as it is")
    logger.info("gc removed a stopped save's claim %s beside a committed checkpoint", _shown(marker))
    return _Outcome(True)


def _as_text(path: str | os.PathLike[str]) -> str:
    """A root as text, a `Path`'s `~` kept a folder of that name (`config.home_expanded`); a str's `~` is read
    where it is used (`discovery.user_path`: the home directory on the local filesystem, a key on a store)."""
    return path if isinstance(path, str) else literal_tilde(os.fspath(path))


class RetentionRunner:
    """Runs the retention pass after each commit, off the training thread, on one rank only.

    The pass for a save starts once that save's write future has resolved successfully (a failed save deletes
    nothing). Passes run one at a time on a single worker thread; any error in a pass is logged, never raised.
    """

    def __init__(self, policy: RetentionPolicy, rank: int, storage: Storage | None = None) -> None:
        self.policy = policy
        self.enabled = rank == 0
        self._storage = storage or default_storage()
        self._pool = WorkerPool(1, "ckpt-retention") if self.enabled else None  # see `futures`
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self._told: set[tuple[str, int]] = set()  # a metric no checkpoint records: told once, not at every save
        self._kept_told: set[tuple[str, str]] = set()  # what gc kept for a person to act on: warned once
        self._stop = Flag()  # set by close() once it stops waiting: the pass running ends at its next safe point
        # What close()'s WARNING says, read with `_stop` set under `_lock` (`_give_up`): read after, a pass that
        # finished in between was said to have stopped "before deleting anything".
        self._root_running: str | None = None  # the root of the pass running
        self._not_started = 0  # passes scheduled that have not begun (a save's write unsettled, or queued)

    def root_for(self, checkpoint_id: str) -> str:
        root = os.fspath(as_local_id(self._storage, _as_text(self.policy.root))) if self.policy.root is not None else ""
        return root or literal_tilde(os.path.dirname(os.path.normpath(checkpoint_id)) or ".")

    def after_commit(self, checkpoint_id: str, write: Future[object] | None) -> None:
        """Schedule the pass for `checkpoint_id`: now for a sync save (write None), else when `write` succeeds."""
        if self._pool is None:
            return
        scheduled: Future[None] = SettledFuture()  # its done() is read on the caller's thread (see futures)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(scheduled)
            self._not_started += 1
        if write is None:
            self._submit(checkpoint_id, scheduled)
            return

        def on_done(f: Future[object]) -> None:
            if f.cancelled() or f.exception() is not None:
                self._never_runs()
                scheduled.set_result(None)  # a failed save deletes nothing
            else:
                self._submit(checkpoint_id, scheduled)

        write.add_done_callback(on_done)

    def _submit(self, checkpoint_id: str, scheduled: Future[None]) -> None:
        def run() -> None:
            try:
                self._run(checkpoint_id)
            finally:
                scheduled.set_result(None)

        with self._lock:
            pool = self._pool
            if pool is not None:
                pool.submit(run)
                return
        self._never_runs()
        scheduled.set_result(None)

    def _never_runs(self) -> None:
        """A pass scheduled will not run (its save failed, or the runner is closed)."""
        with self._lock:
            self._not_started -= 1

    def _run(self, checkpoint_id: str) -> None:
        root: str | os.PathLike[str] = self.policy.root or checkpoint_id  # named if the root itself is refused
        with self._lock:
            self._not_started -= 1
            if self._stop.is_set():  # scheduled before close() gave up on the passes: it deletes nothing now
                return
            self._root_running = _shown(root)
        token = _STOP.set(self._stop)
        try:
            root = self.root_for(checkpoint_id)
            self._root_running = _shown(root)
            # never the checkpoint this pass follows: a run restarted at step 0 beside step_1000 and step_2000
            # (keep_last by step), or an id without a step ("final", a rolling "latest"), lost it at once
            _prune(root, self.policy, self._storage, dry_run=False, protect=(checkpoint_id,), told=self._told)
            if self.policy.collect_garbage and not self._stop.is_set():
                report = collect_garbage(root, self._storage, unowned_after_s=self.policy.unowned_after_s)
                _tell_kept(report, self._kept_told)
        except Exception:  # a retention pass never fails training
            logger.warning("Retention pass under %s failed", _shown(root), exc_info=True)
        finally:
            with self._lock:
                self._root_running = None
            _STOP.reset(token)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the passes scheduled so far (tests, and close())."""
        deadline = Deadline(wait_seconds("RetentionRunner.wait's timeout", timeout))  # none pending, too
        with self._lock:
            pending = list(self._pending)
        for f in pending:  # `timeout` in all, not each
            f.result(deadline.left())

    def close(self, timeout: float | None = 600.0, *, said: str | None = None) -> None:
        """Finish the passes already scheduled (a save that committed gets its pass), then stop the worker, all
        within `timeout`. A timeout no wait can honour is refused (it was logged as passes that "did not finish
        within nans"). Past it, the pass running stops at its next safe point, before its next deletion: it went
        on deleting checkpoints after close() returned, while the script took the manager for closed; so does
        an interrupt (Ctrl-C) of the wait, which close() raises over a manager closed for good. Only the
        step under way finishes, on the worker's (daemon) thread: joining it waited for as long as a pass hung (a
        store that stopped answering). `said`: the timeout as the WARNING names it, where `timeout` is what a
        caller's deadline had left of it (the WARNING named the remainder, "1.9998s")."""
        wait_seconds("RetentionRunner.close's timeout", timeout)
        try:
            self.wait(timeout)
        except TimeoutError:
            running, not_started = self._give_up()
            self._say_stopped(said or f"{timeout}s", running, not_started)
            return
        except BaseException:  # Ctrl-C: close() gives up on the passes as at its timeout (they went on deleting)
            self._give_up()
            raise
        self._shut_down(wait=True)

    def _give_up(self) -> tuple[str | None, int]:
        """Stop the pass running at its next safe point, and the worker once it ends, without waiting. Returns
        the root of the pass stopped running (None: none was) and how many had not begun, as of the stop."""
        with self._lock:
            self._stop.set()
            stopped = self._root_running, self._not_started
        self._shut_down(wait=False)
        return stopped

    def _shut_down(self, *, wait: bool) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait)

    def _say_stopped(self, timeout: str, root: str | None, not_started: int) -> None:
        """What became of the passes as of the stop (`_give_up`); nothing where they all finished meanwhile."""
        if root is None:
            if not_started:  # their saves' writes had not settled, or they were queued: they will not run
                logger.warning(
                    "Retention passes did not finish within %s of close(); %d not yet begun are stopped before "
                    "deleting anything.",
                    timeout,
                    not_started,
                )
            return
        logger.warning(
            "The retention pass under %s did not finish within %s of close(); it is stopped: no further "
            "checkpoint is deleted. The one deletion under way finishes in the background, on a daemon thread (cut "
            "short at interpreter exit, it leaves a trash folder that no load takes for a checkpoint and "
            "`torch-checkpointing gc` removes); the next pass deletes what this one left.",
            root,
            timeout,
        )
