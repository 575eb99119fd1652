"""The commit of one checkpoint, as one object: where files go, what makes them a checkpoint, and the discard.

Two strategies, chosen by `Storage.atomic_rename` (after Orbax's TemporaryPath: atomic rename vs commit file):

* rename (local filesystems): every rank writes into `<parent>/.<name>.tmp-<uid>-<seq>/`, which carries the
  `.incomplete` marker from the start. Rank 0 writes `metadata.json` and `manifest.json`, removes the marker,
  fsyncs, swaps the directory into place (an atomic exchange when it replaces a checkpoint), fsyncs the parent.
* commit file (object stores, which cannot rename a prefix): every rank writes directly under the final prefix,
  with the marker; once every rank's files are complete rank 0 writes the manifest and removes the marker
  LAST. Overwriting an id that already has a manifest is refused (it could not be done atomically), and a
  prefix without a manifest is not a checkpoint. Two saves of one id would write the same keys, so the marker
  is also the save's claim on the id (`Claim`): created only if absent, before the first upload, and checked
  again before the commit; a claim whose owner is provably gone is taken over only if unchanged.

What a save may replace is decided here too (`check_target`): nothing, an empty directory, a failed save of
ours, or, with overwrite allowed, a checkpoint of ours that holds nothing but the files its manifest lists.
Anything else (a user's directory, a regular file, a symlink) is refused before a byte is written. Once the
checkpoint is in place the save has succeeded: a failure to clean up after it is a logged warning, never an
error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import logging
import math
import os
import posixpath
import re
import stat
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch_checkpointing.distributed_metadata import METADATA_FILE_NAME
from torch_checkpointing.errors import (
    CheckpointError,
    CommitError,
    CommitOutcomeUnknownError,
    NewerCheckpointError,
    ObjectStoreError,
    log_safely,
)
from torch_checkpointing.futures import WorkerPool
from torch_checkpointing.manifest import (
    GC_TOKEN_PREFIX,
    INCOMPLETE_MARKER,
    MANIFEST_FILE_NAME,
    UNNAMED_SAVE,
    Manifest,
    gc_collects,
    our_marker,
    parse_manifest,
    read_bounded,
    read_marker,
    shown_name,
    stray_claim,
)
from torch_checkpointing.names import (
    ASIDE_RE,
    CREATING_RE,
    TMP_RE,
    TRASH_RE,
    aside_of,
    fit_name,
    made_here,
    pid_alive,
    same_host,
    this_host,
)
from torch_checkpointing.signals import signals_deferred
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import raise_unless_removed, remove_tree_marks_last

__all__ = [
    "INCOMPLETE_MARKER",
    "MANIFEST_FILE_NAME",
    "METADATA_FILE_NAME",
    "RESERVED_FILE_NAMES",
    "Claim",
    "Commit",
    "CommitTarget",
    "ConditionalStorage",
    "MadeDirectory",
    "TaggedStorage",
    "UploadingStorage",
    "abort_unfinished",
    "check_target",
    "make_parents",
    "manifest_digest",
    "record_name",
    "remove_made",
    "remove_recorded",
    "remove_saves_objects",
    "stale_reason",
    "temporary_name",
    "unfinished_uploads",
    "warn_left_in_place",
    "working_directory_is_not_the_programs",
]

logger = logging.getLogger("torch_checkpointing.commit")

# Files the engine itself writes at a checkpoint's root; an item may not claim them.
RESERVED_FILE_NAMES = frozenset({MANIFEST_FILE_NAME, METADATA_FILE_NAME, INCOMPLETE_MARKER})
_SHOWN = 8  # how many unexpected entries a refusal lists
# A claim older than this is stale whoever holds it: no save takes a day, and gc waits as long for temporaries
# whose owner it cannot check (retention.DEFAULT_UNOWNED_AGE_S).
STALE_CLAIM_S = 24 * 3600.0
_CLAIM_ATTEMPTS = 4  # creates/takeovers tried while other savers change the marker
_CLAIM_WAIT_S = 5.0  # how long a claim that looks live is watched before the save is refused
_CLAIM_POLL_S = 0.25
_TOKEN_RE = re.compile(r"\.tmp-(?P<uid>[0-9a-f]+)-[0-9]+$")
# On a store that records no writer per object (all but S3), each rank of a save records the names it writes in
# `.incomplete.<save>.<rank>` beside the marker, before its first upload (`record_name`, `remove_recorded`).
_DELETES_AT_ONCE = 16  # a save of many ranks has as many records, each one DELETE on the commit's path
_DELETE_POOL = WorkerPool(1, "ckpt-delete")  # grown to the deletes at once (map_bounded)
_RECORD_RE = re.compile(rf"^{re.escape(INCOMPLETE_MARKER)}\.[0-9a-f]{{16}}\.[0-9]+$")


@dataclass(frozen=True)
class MadeDirectory:
    """A directory a save created (the id's missing parents), by identity: a failed save removes it only if it is
    still that same, empty directory, never one that another program put at its path since."""

    path: str
    dev: int
    ino: int


@dataclass(frozen=True)
class CommitTarget:
    """Where one save lands: the checkpoint's path, its temporary name, and whether it may replace one.

    `made` are the parent directories the save created for the id (outermost first), removed with it on failure.
    """

    final: str
    tmp: str
    overwrite: bool = True
    made: tuple[MadeDirectory, ...] = ()


def make_parents(storage: Storage, final: str) -> tuple[MadeDirectory, ...]:
    """Create the id's parent directory and record which of its ancestors this call created.

    A failed save must leave nothing that was not there before: the parents made for it go with it
    (`remove_made`). Only local paths are recorded; a store's prefixes vanish with their last object.
    """
    parent = Path(final).parent if str(Path(final).parent) else Path(".")
    local = storage.local_path(parent)
    missing: list[str] = []
    if local is not None:
        current = os.path.abspath(local)
        while not os.path.lexists(current):
            missing.append(current)
            current = os.path.dirname(current)
    try:
        storage.mkdir(parent)
    except BaseException:  # (EACCES, ENOSPC) on one of them: those made before it go again
        remove_made(_made(reversed(missing)))
        raise
    return _made(reversed(missing))


def _made(paths: Iterable[str]) -> tuple[MadeDirectory, ...]:
    """The directories among `paths` that exist now, by identity (outermost first, as `paths` come)."""
    made = []
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            break  # not made: nor is anything below it
        made.append(MadeDirectory(path, st.st_dev, st.st_ino))
    return tuple(made)


def remove_made(made: tuple[MadeDirectory, ...]) -> None:
    """Remove, innermost first, the directories a failed save made that are still its own and empty.

    One that now holds anything (another save's checkpoint, a user's file) or that was replaced (another inode)
    is left as it is, and so is everything above it.
    """
    for entry in reversed(made):
        try:
            st = os.lstat(entry.path)
        except FileNotFoundError:
            continue  # removed already (the writer's discard, then the trainer's)
        if (st.st_dev, st.st_ino) != (entry.dev, entry.ino) or not stat.S_ISDIR(st.st_mode):
            logger.warning("Not removing %s after the failed save: it is no longer the directory it made", entry.path)
            return
        try:
            os.rmdir(entry.path)
        except OSError as exc:
            logger.info("Not removing %s after the failed save: %s", entry.path, exc.strerror)
            return


def manifest_digest(manifest_bytes: bytes) -> str:
    """What tells one save's manifest from any other's (it holds the save's commit time and file checksums), short
    enough to pass through the checkpoint store for every save of a run."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def temporary_name(final: str, uid: str, seq: int) -> str:
    """The hidden sibling a rename-mode save writes into (`.step_5.tmp-<uid>-<seq>`).

    The name part is shortened to keep the whole within NAME_MAX: an id's own name may use all 255 bytes,
    and its temporary name must not then fail with ENAMETOOLONG. `<uid>-<seq>` keeps it unique.
    """
    path = Path(final)
    return str(path.parent / fit_name(".", path.name, f".tmp-{uid}-{seq}"))


# ------------------------------------------------------------------------------------- what may be replaced


def check_target(storage: Storage, final: str, overwrite: bool) -> bool:
    """Refuse, before anything is written, a target whose replacement could lose data that is not ours.

    Returns whether there is a directory to replace (False: nothing at the id yet).
    """
    path, shown = Path(final), shown_name(storage, final)
    local = storage.local_path(path)
    if local is not None and os.path.islink(local):
        raise CommitError(
            f"Refusing to save to {final}: it is a symbolic link (to {os.readlink(local)!r}). Save to the real "
            f"path, or remove the link first."
        )
    if local is not None:
        _check_ancestors(storage, final, local)
    for _ in range(_LOOK_AGAIN):
        try:
            return _check_what_is_there(storage, final, overwrite)
        except _ChangedWhileLooked:
            continue  # a deletion or another save of the id took what was listed: look at what is there now
    raise CommitError(
        f"Refusing to save to {shown}: what is at the id changed {_LOOK_AGAIN} times while this save looked at it "
        f"(other processes saving or deleting it in a loop); nothing was written. Retry the save, or save to "
        f"an id of its own."
    )


_LOOK_AGAIN = 5
"""How many times `check_target` looks at an id that changed under its look before it gives up."""


class _ChangedWhileLooked(Exception):
    """What the check listed at the id went away before it was read: looked at again, never a refusal."""


def _check_what_is_there(storage: Storage, final: str, overwrite: bool) -> bool:
    """`check_target`'s look at what the id holds now.

    A checkpoint a `prune` (or a retention pass) renamed to its trash, or another save exchanged, between the
    listing and the read of its manifest raises `_ChangedWhileLooked`: before, the save failed with "its
    manifest.json is not a torch_checkpointing manifest ... Choose another id" (or a bare FileNotFoundError
    where the listing itself lost the directory, "it is an existing file" where the id went between being found and
    being asked whether it is a directory), though a save beside a deletion commits by moving in."""
    path, shown = Path(final), shown_name(storage, final)
    local = storage.local_path(path)
    if not storage.exists(path):
        return False
    if not storage.isdir(path):
        if not storage.exists(path):  # found, then gone: not a file, a directory deleted since
            raise _ChangedWhileLooked
        raise CommitError(f"Refusing to save to {shown}: it is an existing file, not a checkpoint. Choose another id.")
    try:
        entries = _walk(storage, path)
    except FileNotFoundError as exc:
        raise _ChangedWhileLooked from exc
    names = set(entries)
    if MANIFEST_FILE_NAME in names:
        _check_checkpoint(storage, final, entries, overwrite)
    elif entries and not _failed_save_of_ours(storage, path, names):
        raise CommitError(
            f"Refusing to save to {shown}: it is a directory that is not a checkpoint (no {MANIFEST_FILE_NAME}); "
            f"it holds {_listing(entries)}. Saving would replace it. Choose another id (e.g. a subdirectory)."
        )
    if local is not None:  # replaceable by what it holds (empty, ours), but not while the program runs in it
        _refuse_working_directory(final, local)
    return True


def _failed_save_of_ours(storage: Storage, root: Path, names: set[str]) -> bool:
    """Whether a directory without a manifest is what a failed save or delete of ours leaves at an id.

    On a store without rename a save writes under the id itself, behind its marker: the marker and any of
    its files. Where saves rename, nothing of ours is ever written at the id but a committed checkpoint, and
    deleting one in place removes the marker last: the marker alone, an empty regular file. A user's folder that
    merely holds a file named `.incomplete` (a download tool's) is not ours, and replacing it deleted every file
    in it; nor is a lone `.incomplete` that is a link or holds bytes (taken by its name, it was removed).
    """
    rest = {n for n in names if not _marker_being_created(n)}
    if INCOMPLETE_MARKER not in rest:  # a marker's create killed before its link (no O_TMPFILE) leaves only that
        return bool(names) and not rest and not storage.atomic_rename
    if not storage.atomic_rename:
        return True
    return rest == {INCOMPLETE_MARKER} and _lone_marker_of_ours(storage, root)


def _lone_marker_of_ours(storage: Storage, root: Path) -> bool:
    """Whether the `.incomplete` alone at an id where saves rename is the empty regular file we leave: read
    as every marker is (`read_marker`: no link followed, no FIFO), so a link or another program's file is not."""
    try:
        return not read_marker(storage, root / INCOMPLETE_MARKER)
    except ObjectStoreError:  # the store failed the read: that tells nothing of the marker, and is the caller's
        raise
    except (OSError, CheckpointError):
        return False


def _marker_being_created(name: str) -> bool:
    """Whether `name` holds a marker's bytes before their link under its name (`names.CREATING_RE`)."""
    match = CREATING_RE.match(name)
    return match is not None and match["name"] == INCOMPLETE_MARKER


# What each of the engine's working directories is, as `inside_working_directory` names it.
_WORKING_KINDS = (
    (TMP_RE, "the temporary directory of a save"),
    (TRASH_RE, "the trash of a deletion"),
    (ASIDE_RE, "a replaced checkpoint's copy aside"),
)


def inside_working_directory(path: str | os.PathLike[str]) -> str | None:
    """Why nothing may be written at `path`: it is or lies in one of the engine's working directories (named,
    with what it is); None when it does not.

    A save's temporary is renamed to its id at the commit, and it, a deletion's trash and a replaced copy aside
    are removed whole by gc (and every retention pass) once their maker is gone: a checkpoint or an export put in
    one would become part of another checkpoint, or go with it. A folder so named counts as gc counts it: while it
    holds a manifest or the `.incomplete` marker at its top (a user's `.old_runs_2` holds neither)."""
    folder = os.path.abspath(path)
    while True:
        name = os.path.basename(folder)
        what = next((what for pattern, what in _WORKING_KINDS if pattern.match(name)), None)
        if what is not None and any(os.path.lexists(os.path.join(folder, top)) for top in _OURS_AT_TOP):
            return (
                f"it lies inside {folder}, {what}, which the engine renames into place or removes whole "
                f"(`torch-checkpointing gc`) once its maker is gone"
            )
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


_OURS_AT_TOP = (MANIFEST_FILE_NAME, INCOMPLETE_MARKER)  # at the top of each until its last file goes


def _check_ancestors(storage: Storage, final: str, local: str) -> None:
    """Refuse an id the save cannot create (under a file or a dangling link) or one inside a checkpoint of ours or
    one of our working directories (`inside_working_directory`).

    Saved inside another checkpoint, the new one would be files that checkpoint does not list: it could no
    longer be replaced, and deleting it (retention, gc) would take the inner one along.
    """
    ancestor = os.path.dirname(os.path.abspath(local))
    if (why := inside_working_directory(ancestor)) is not None:
        raise CommitError(f"Refusing to save to {final}: {why}. Choose an id outside it.")
    while True:
        if os.path.isdir(ancestor):
            if _is_checkpoint(storage, os.path.join(ancestor, MANIFEST_FILE_NAME)):
                raise CommitError(
                    f"Refusing to save to {final}: it is inside the checkpoint {ancestor}, which would then hold "
                    f"files its manifest does not list. Save beside it (e.g. {ancestor}_{os.path.basename(local)})."
                )
        elif os.path.islink(ancestor):
            raise CommitError(
                f"Refusing to save to {final}: {ancestor} is a symbolic link to {os.readlink(ancestor)!r}, which "
                f"does not exist. Create the directory it points to, or remove the link."
            )
        elif os.path.lexists(ancestor):
            raise CommitError(
                f"Refusing to save to {final}: {ancestor} is an existing file, not a directory, so the checkpoint "
                f"cannot be created under it. Choose another id."
            )
        parent = os.path.dirname(ancestor)
        if parent == ancestor:
            return
        ancestor = parent


_working_directory_is_the_programs = True


def working_directory_is_not_the_programs() -> None:
    """Said by the async writer process: its working directory is the one it was started in, not the program's
    (the trainer checks its own when the save is planned), so it is no reason to refuse a target there."""
    global _working_directory_is_the_programs
    _working_directory_is_the_programs = False


def _refuse_working_directory(final: str, local: str) -> None:
    """Refuse a target that is this process's working directory or holds it (an empty folder the job was started
    in, a checkpoint of ours someone `cd`-ed into, or an empty folder inside one, which no listing counts as a
    file): replacing it deleted the directory the program runs in, and every relative path failed after."""
    if not _working_directory_is_the_programs:
        return
    try:
        target = os.stat(local)
        cwd = os.getcwd()
    except OSError:  # nothing there yet, or the working directory is already gone
        return
    here = cwd
    while True:
        try:
            st = os.stat(here)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            what = "is" if here == cwd else "holds"
            raise CommitError(
                f"Refusing to save to {final}: it {what} the working directory of this process ({cwd}); replacing "
                f"it would delete the directory the program runs in. Save to another id, or change directory "
                f"(os.chdir) out of it first."
            )
        parent = os.path.dirname(here)
        if parent == here:
            return
        here = parent


def _is_checkpoint(storage: Storage, manifest_path: str) -> bool:
    """Whether this file is one of our manifests (a web app's manifest.json is not), a newer engine's included:
    this engine does not read that one, but a save inside its checkpoint is as wrong as inside one of ours."""
    if not os.path.isfile(manifest_path):
        return False
    try:
        _read_manifest(storage, Path(manifest_path))
    except NewerCheckpointError:
        return True
    except (OSError, CheckpointError, ValueError, KeyError, UnicodeDecodeError):
        return False
    return True


def _read_manifest(storage: Storage, path: Path) -> Manifest:
    """Parse a manifest found at a target, read bounded (`manifest.read_bounded`): a local one is opened without
    blocking or following a link.

    (A FIFO named manifest.json made the check wait forever for a writer; a huge file is refused unread.)
    """
    return parse_manifest(read_bounded(storage, path), str(path))


def _check_checkpoint(storage: Storage, final: str, entries: list[str], overwrite: bool) -> None:
    """An existing checkpoint of ours: replaceable only if allowed, atomic, and holding nothing else."""
    shown = shown_name(storage, final)
    try:
        manifest = _read_manifest(storage, Path(final) / MANIFEST_FILE_NAME)
    except NewerCheckpointError:
        raise CommitError(
            f"Refusing to save to {shown}: a newer engine wrote the checkpoint there (a higher manifest_version), "
            f"and this engine cannot tell what replacing it would lose. Save to another id, or replace it with "
            f"that engine."
        ) from None
    except FileNotFoundError as exc:  # listed, then gone: deleted or replaced since
        raise _ChangedWhileLooked from exc
    except ObjectStoreError:  # the store failed the read (refused, failing): no word on whose manifest it is
        raise
    except (OSError, CheckpointError, ValueError, KeyError, UnicodeDecodeError) as exc:
        raise CommitError(
            f"Refusing to save to {shown}: its {MANIFEST_FILE_NAME} is not a torch_checkpointing manifest ({exc}). "
            f"Choose another id."
        ) from None
    if _unfinished_at(storage, Path(final), manifest):
        raise CommitError(
            f"Refusing to save to {shown}: it holds an unfinished save or delete of ours, no checkpoint (its "
            f"{MANIFEST_FILE_NAME} beside the {INCOMPLETE_MARKER} claim of a save or delete that is running, or was "
            f"killed); its files are not this save's to overwrite. Run `torch-checkpointing gc "
            f"{shown_name(storage, str(Path(final).parent))}` (it removes them once that claim is dead), then save "
            f"again; or save to another id."
        )
    if not overwrite:
        raise CommitError(
            f"Refusing to save to {shown}: a checkpoint already exists there and overwrite is off "
            f"(CheckpointSaverConfig.overwrite=False). Choose another id, or delete it first."
        )
    if not storage.atomic_rename:
        raise CommitError(
            f"Refusing to save to {shown}: a checkpoint already exists there, and this storage cannot replace "
            f"one atomically (Storage.atomic_rename=False). Delete it first, or save to a new id."
        )
    foreign = _unlisted(storage, Path(final), entries, manifest)
    if foreign:
        raise CommitError(
            f"Refusing to replace the checkpoint {shown}: it also holds files that are not part of it "
            f"({_listing(foreign)}); replacing it would delete them. Move them out, or save to another id."
        )


def _unfinished_at(storage: Storage, root: Path, manifest: Manifest) -> bool:
    """Whether the manifest at `root` is an unfinished save's or delete's: on a store where the marker is a claim,
    one of ours beside it that is no stray claim (`stray_claim`). Before, a save of an id a killed delete left
    (its claim, its manifest, some files) was refused as over "a checkpoint [that] already exists there ...
    Delete it first", though nothing there lists or loads, and no fix was named."""
    if storage.atomic_rename:
        return False
    try:
        marker = read_marker(storage, root / INCOMPLETE_MARKER)
    except ObjectStoreError:  # the store failed the read: that tells nothing of the marker, and is the caller's
        raise
    except (OSError, CheckpointError):
        return False
    return our_marker(marker) and not stray_claim(marker, manifest)


def files_not_listed(storage: Storage, path: Path) -> list[str]:
    """The files under a checkpoint directory that its manifest does not list (a user's notes, a nested
    checkpoint): what replacing or deleting the checkpoint would lose. Every file and every empty folder when no
    manifest can be read (then the directory is not ours to remove: a directory of empty folders was deleted,
    which a save refuses to replace as "not a checkpoint")."""
    entries = _walk(storage, path)
    try:
        manifest = _read_manifest(storage, path / MANIFEST_FILE_NAME)
    except ObjectStoreError:  # the store failed the read: its files were all called foreign, the error dropped
        raise
    except (OSError, CheckpointError, ValueError, KeyError, UnicodeDecodeError):
        return [e for e in entries if not e.endswith("/")] + _empty_folders(entries, set())
    return _unlisted(storage, path, entries, manifest)


def _unlisted(storage: Storage, root: Path, entries: list[str], manifest: Manifest) -> list[str]:
    """The files under the checkpoint `root` that are not provably its own (its manifest, the files it lists,
    the sharding metadata it names, and a marker of ours, only where a commit writes under the id itself), and
    the empty folders none of those belongs in.

    Before, the engine's file names were taken as proof by themselves: a user's `.incomplete` (a download's
    progress) or `metadata.json` in a checkpoint saved without one was deleted by the replace or delete."""
    known = {posixpath.normpath(rec.path) for rec in manifest.files} | {MANIFEST_FILE_NAME}
    if manifest.metadata_file is not None:
        known.add(posixpath.normpath(manifest.metadata_file))
    if INCOMPLETE_MARKER in entries and _marker_of_ours(storage, root):
        known.add(INCOMPLETE_MARKER)
    return [e for e in entries if not e.endswith("/") and e not in known] + _empty_folders(entries, known)


def _empty_folders(entries: list[str], known: set[str]) -> list[str]:
    """The folders among `_walk`'s entries with nothing below them and no file of the checkpoint's meant to be
    in them: another program's (a save makes a folder only for the files its layout puts there), which replacing
    or deleting the checkpoint removed though its manifest does not list it. An emptied folder of a listed file
    (a removal killed midway, which removes the manifest last) is still the checkpoint's."""
    holding = {e.rstrip("/").rpartition("/")[0] + "/" for e in entries if "/" in e.rstrip("/")}
    empty = [e for e in entries if e.endswith("/") and e not in holding]
    if not empty:
        return []
    ours = {path[: i + 1] for path in known for i, c in enumerate(path) if c == "/"}
    return [e for e in empty if e not in ours]


def _marker_of_ours(storage: Storage, root: Path) -> bool:
    """Whether the `.incomplete` beside a manifest is one of ours: never where saves rename (the commit removes
    it before the checkpoint moves to its id, a delete renames it away first); elsewhere an empty marker or a
    claim (a delete or a commit under way at the id)."""
    if storage.atomic_rename:
        return False
    try:
        return our_marker(read_marker(storage, root / INCOMPLETE_MARKER))
    except (OSError, CheckpointError):
        return False


def _walk(storage: Storage, root: Path) -> list[str]:
    """Every file below `root`, relative; directories end with '/' (empty ones too).

    A symbolic link is an entry, never descended into: we write none, and one pointing at `/usr` or at a
    directory that links to itself would keep the walk going for hours.
    """
    out: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        for name in sorted(storage.ls(root / rel) if rel else storage.ls(root)):
            child = f"{rel}{name}"
            if storage.isdir(root / child) and not _is_link(storage, root / child):
                out.append(child + "/")
                stack.append(child + "/")
            else:
                out.append(child)
    return out


def _is_link(storage: Storage, path: Path) -> bool:
    return storage.is_link(path)


def _listing(entries: list[str]) -> str:
    top = sorted({e.split("/")[0] + ("/" if "/" in e else "") for e in entries})
    more = f" and {len(top) - _SHOWN} more" if len(top) > _SHOWN else ""
    return ", ".join(top[:_SHOWN]) + more


# ------------------------------------------------------------------------------------------- the claim


@runtime_checkable
class ConditionalStorage(Protocol):
    """A store that creates an object only if absent and replaces or deletes one only if unchanged (S3's
    If-None-Match / If-Match): what makes the object-store marker an exclusive claim (FsspecStorage)."""

    def create_object(self, path: Path, data: bytes) -> bool: ...

    def read_object(self, path: Path) -> tuple[bytes, str] | None: ...

    def replace_object(self, path: Path, data: bytes, etag: str) -> bool: ...

    def delete_object(self, path: Path, etag: str) -> bool: ...


@runtime_checkable
class TaggedStorage(Protocol):
    """A store that records which save uploaded an object (S3's user metadata, `FsspecStorage`): what lets a
    failed save under its final id remove its own objects and leave the ones others PUT there meanwhile."""

    def own_writes(self, root: Path, token: str) -> bool: ...

    def objects_by_save(self, root: Path) -> tuple[dict[str, tuple[str, str]], list[str]] | None: ...

    def delete_unchanged(self, root: Path, etags: dict[str, str]) -> list[str]: ...


@runtime_checkable
class UploadingStorage(Protocol):
    """A store whose large uploads are multipart uploads that hold their parts, billed, until completed or
    aborted (S3, `FsspecStorage`): what a writer killed mid-upload, or a create whose answer was lost, leaves."""

    def unfinished_uploads(self, root: Path) -> list[tuple[str, str]]: ...

    def abort_uploads(self, root: Path, uploads: list[tuple[str, str]]) -> list[str]: ...


def unfinished_uploads(storage: object, root: Path) -> list[tuple[str, str]]:
    """The unfinished multipart uploads under `root/`, listed while the caller still holds (or has judged dead)
    the id's claim: every one is then a dead or failed save's, none of a save that claims the id later. [] where
    the store makes none, or cannot list them (said at WARNING: they stay until a lifecycle rule aborts them)."""
    if not isinstance(storage, UploadingStorage):
        return []
    try:
        return storage.unfinished_uploads(root)
    except Exception as exc:
        log_safely(logger, logging.WARNING, "Could not list the unfinished uploads under %s: %s", root, exc)
        return []


def abort_unfinished(storage: object, root: Path, uploads: list[tuple[str, str]], what: str) -> None:
    """Abort `uploads` (from `unfinished_uploads`, once the claim they were listed under is gone)."""
    if not uploads or not isinstance(storage, UploadingStorage):
        return
    try:
        left = storage.abort_uploads(root, uploads)
    except Exception as exc:  # none known aborted: every one may still be there, billed
        _tell_not_aborted(what, [f"{key} (upload {upload_id})" for key, upload_id in uploads], exc)
        return
    if left:
        _tell_not_aborted(what, left)
    logger.info("%s aborted %d unfinished multipart upload(s)", what, len(uploads) - len(left))


def _tell_not_aborted(what: str, left: list[str], exc: Exception | None = None) -> None:
    """Unfinished uploads an abort left: their parts stay billed, so a person must hear of it (WARNING)."""
    log_safely(
        logger,
        logging.WARNING,
        "%s could not abort %d unfinished multipart upload(s)%s: %s. Their parts stay billed until aborted "
        "(`aws s3api abort-multipart-upload`) or removed by a lifecycle rule for incomplete uploads.",
        what,
        len(left),
        f" ({type(exc).__name__}: {exc})" if exc is not None else "",
        ", ".join(left),
    )


def remove_saves_objects(storage: TaggedStorage, root: Path, objects: dict[str, tuple[str, str]]) -> list[str]:
    """Delete each of a save's objects under `root` only if it is still the version seen (its ETag): one a user
    PUT over it since stays. Returns the names left in place: those that changed, and those inside another
    checkpoint or save below `root` (`_inside_nested`). The marker is not touched."""
    inside = _inside_nested(objects)
    doomed = {rel: etag for rel, (_, etag) in objects.items() if rel != INCOMPLETE_MARKER and rel not in inside}
    return sorted([*storage.delete_unchanged(root, doomed), *inside])


def _inside_nested(names: Iterable[str]) -> set[str]:
    """The names below a sub-prefix that holds a manifest or a marker of its own: a checkpoint committed (or a
    save made) under the dead save's id by a manager rooted inside it (`s3://bucket/a` saving `b`). Its objects
    are tagged by a save of ours as well, and before, a cleanup of `a` deleted that committed checkpoint."""
    names = set(names)
    nested = {
        posixpath.dirname(rel)
        for rel in names
        if "/" in rel and posixpath.basename(rel) in (MANIFEST_FILE_NAME, INCOMPLETE_MARKER)
    }
    return {rel for rel in names if any(rel.startswith(f"{prefix}/") for prefix in nested)}


def warn_left_in_place(url: str, left: list[str], what: str) -> None:
    """Name the objects a cleanup found under a save's id that the save did not write (a user's or another
    program's, PUT while it ran or over one of its keys): they stay, and the id holds no checkpoint of ours."""
    left = sorted(set(left) - {INCOMPLETE_MARKER})
    if not left:
        return
    shown = ", ".join(f"{url}/{rel}" for rel in left[:_SHOWN]) + (" ..." if len(left) > _SHOWN else "")
    log_safely(
        logger,
        logging.WARNING,
        "%s removed the save's own files and left %d object(s) in place that were not written by this save (put "
        "there by a user or another program while it ran, or over one of its keys): %s. Saving to this id is "
        "refused while they are there: move or delete them, or save under another id.",
        what,
        len(left),
        shown,
    )


def record_name(token: str, rank: int) -> str:
    """The name, beside the marker, of the record of what rank `rank` of the save `token` writes (a hash of the
    token keeps it short: the token holds the checkpoint's own name)."""
    return f"{INCOMPLETE_MARKER}.{hashlib.sha256(token.encode('utf-8')).hexdigest()[:16]}.{rank}"


def _records_of(storage: Storage, root: Path, token: str | None = None) -> list[str]:
    """The names of the records under `root` (of the save `token`, or of any save)."""
    names = [name for name in storage.ls(root) if _RECORD_RE.match(name)]
    if token is None:
        return names
    return [name for name in names if _save_of(name) == _save_of(record_name(token, 0))]


def _recorded_files(storage: Storage, root: Path, record: str) -> set[str] | None:
    """The names one record lists; a name that is not a plain path inside the root (`../x`, `/x`, `a//b`) is
    never joined back into a path to delete. A record gone names nothing; one that is not ours (unreadable, or
    its "files" no list of names: `"abc"` was read as the names a, b, c, each deleted; JSON nested past the
    parser's recursion, whose bare RecursionError failed the gc pass) is None, logged: its names are never used,
    and it is left in place.

    Read as a manifest is (`read_bounded`: it lists no more than the manifest does), its size checked before a
    byte is read: a file named like one, of 1 GiB, was read whole into gc's memory (twice over) to find it was
    not JSON."""
    try:
        files = json.loads(read_bounded(storage, root / record, "a record of a save's files"))["files"]
        if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
            raise TypeError(f'its "files" is not a list of names: {files!r:.80}')
        names = set(files)
    except FileNotFoundError:
        return set()
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, RecursionError, CheckpointError) as exc:
        logger.warning(
            "Ignoring the record %s of a save's files: it is not one of ours (%s); none of the names it lists is "
            "deleted, and it is left in place (delete it by hand if it is garbage)",
            storage.remap_path(root / record),
            exc,
        )
        return None
    return {n for n in names if n and posixpath.normpath(n) == n and not n.startswith(("/", "../")) and n != ".."}


def remove_recorded(storage: Storage, root: Path, manifest: Manifest | None) -> list[str]:
    """Remove, under a claimed prefix of a store that records no writer per object, what saves of ours wrote
    there: the names their records list (every save's: those whose claims were taken over are as dead), the
    files `manifest` (the dead save's own, or this claim's) lists, then that manifest, then the records, and the
    directories left empty. Returns the other files (a user's, another program's), left in place. The marker is
    not touched.

    The manifest goes after the files it lists, never before: it may be the only list of them (a save killed
    after its manifest, its records gone), and a gc killed between the two left them for good, named as a
    user's ("left in place ... not written by this save"), the id refused to every later save. Beside the
    claim this runs under (gc's names the save it collects), the manifest is no committed checkpoint.

    A file a user put at one of the recorded names cannot be told apart from the save's and goes with it.
    """
    records, ours = _our_records(storage, root, _records_of(storage, root))
    if manifest is not None:
        ours |= {posixpath.normpath(rec.path) for rec in manifest.files} | {METADATA_FILE_NAME, MANIFEST_FILE_NAME}
    entries = _walk(storage, root)
    left = [rel for rel in entries if not rel.endswith("/") and rel not in ours]
    present = ours & set(entries)
    _delete_all(storage, root, sorted(present - {MANIFEST_FILE_NAME}))
    _delete_all(storage, root, sorted(present & {MANIFEST_FILE_NAME}))
    _delete_all(storage, root, records)
    _remove_emptied(storage, root, ours)
    return sorted(set(left) - {INCOMPLETE_MARKER, *records})


def unlisted_files(storage: Storage, root: Path, claim: Claim | None) -> list[str]:
    """The files under the dead save's prefix `root` that nothing tells apart as ours, where its marker's claim
    (`claim`; None: an empty marker, an earlier version's) records none of what the save wrote: all but the
    marker and, where a manifest of that save's is there, `manifest.json`, `metadata.json` and what it lists."""
    ours = {INCOMPLETE_MARKER}
    try:
        manifest: Manifest | None = Manifest.from_json(read_bounded(storage, root / MANIFEST_FILE_NAME))
    except FileNotFoundError:
        manifest = None
    except (CheckpointError, ValueError, KeyError, UnicodeDecodeError):
        manifest = None  # not a manifest of ours: it is listed with the rest
    if manifest is not None and (claim is None or claim.owns(manifest)):
        ours |= {posixpath.normpath(rec.path) for rec in manifest.files} | {MANIFEST_FILE_NAME, METADATA_FILE_NAME}
    return [rel for rel in _walk(storage, root) if not rel.endswith("/") and rel not in ours]


def _our_records(storage: Storage, root: Path, records: list[str]) -> tuple[list[str], set[str]]:
    """Of `records`, those that are ours, and the names they list together (one not ours is named and left)."""
    read = {record: _recorded_files(storage, root, record) for record in records}
    ours = [record for record, names in read.items() if names is not None]
    return ours, set().union(*(read[record] or set() for record in ours))


def _remove_emptied(storage: Storage, root: Path, removed: Iterable[str]) -> None:
    """The directories above the removed files that hold nothing now, innermost first (a user's file in one
    keeps it, and the directories above it)."""
    for directory in sorted(_parents(removed), key=len, reverse=True):
        with contextlib.suppress(FileNotFoundError):
            here = root / directory
            if storage.isdir(here) and not _is_link(storage, here) and not storage.ls(here):
                storage.rmdir(root / directory)


def _save_of(record: str) -> str:
    """The save a record belongs to: its name without the rank (`.incomplete.<hash of token>`)."""
    return record.rsplit(".", 1)[0]


def _remove_taken_over(storage: Storage, root: Path, token: str, kept: set[str]) -> list[str]:
    """Remove what the dead saves whose claims the save `token` took over recorded under `root`, except `kept`
    (the names that save writes itself), then their records; returns the names removed.

    Without this the new save committed with them still there: files its manifest does not list, that no marker
    pointed gc at any more, kept for good (and a record that made the checkpoint look half-written).
    """
    dead = [record for record in _records_of(storage, root) if _save_of(record) != _save_of(record_name(token, 0))]
    if not dead:
        return []
    dead, names = _our_records(storage, root, dead)
    names -= kept
    present = sorted(names & set(_walk(storage, root)))
    _delete_all(storage, root, present)
    _delete_all(storage, root, dead)
    _remove_emptied(storage, root, present)
    return present


def _delete_all(storage: Storage, root: Path, names: list[str]) -> None:
    """Delete `root/name` for each name, several at once (one request each on an object store); one gone
    already (another cleanup's) is no failure, the first other failure is raised once every started delete
    has stopped."""

    def delete(name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            storage.delete(root / name)

    _DELETE_POOL.map_bounded(delete, names, _DELETES_AT_ONCE)


def _parents(names: Iterable[str]) -> set[str]:
    """Every directory above `names` inside the root (`a`, `a/b` for `a/b/c`)."""
    out: set[str] = set()
    for name in names:
        parent = posixpath.dirname(name)
        while parent and parent not in out:
            out.add(parent)
            parent = posixpath.dirname(parent)
    return out


def _no_constant(name: str) -> float:
    """`json.loads`' `parse_constant` for a claim: `NaN`/`Infinity` are no JSON, and none of our writers emits them."""
    raise ValueError(f"the non-standard JSON constant {name}")


@dataclass(frozen=True)
class Claim:
    """Which save writes under an object-store id: the body of its `.incomplete` marker.

    `token` is the save's temporary name (`<uid>-<seq>` inside), the same on every rank of one save and on
    no other save; `uid` is the job's, `host`/`pid` the process that made the claim, `created` its time.
    """

    token: str
    uid: str
    host: str
    pid: int
    created: float
    # Its save's uploads name its token (`TaggedStorage`): what is untagged under it is not its own. A claim of
    # an earlier version (no such record) is collected whole, as it always was.
    tags: bool = False
    # Its ranks name what they write in records beside the marker (`record_name`): on stores without tags,
    # what no record names is not its own.
    records: bool = False
    # It replaced a dead save's claim: that save's uploads under the id (tagged with its token) may still be there.
    took_over: bool = False
    # gc's claim only: the token of the dead save whose prefix it deletes (the manifest there names it).
    collects: str = ""

    @classmethod
    def of(cls, target: CommitTarget) -> Claim:
        token = Path(target.tmp).name
        match = _TOKEN_RE.search(token)
        return cls(token, match["uid"] if match else "", this_host(), os.getpid(), time.time())

    @classmethod
    def for_gc(cls, dead: Claim, uid: str = "") -> Claim:
        """gc's own claim on a dead save's prefix while it deletes what that save recorded: a save of the id
        finds it live (this process) and waits or is refused, rather than taking the id over and writing files
        that gc's deletes, listed before, then removed. Killed, it is as dead as the save's was.

        It names the save it collects (`dead`, or the one a killed gc's claim `dead` named), whose manifest may
        still be there: readers take that manifest as unfinished, and the next gc deletes it
        (`manifest.stray_claim`).

        `uid` names the owner lock the gc pass holds while it runs ('' where it could take none): once the pass
        is over, however it ended, the claim is dead on this host although its process lives on."""
        token = f"{GC_TOKEN_PREFIX}{uuid.uuid4().hex}"
        collects = (dead.collects if dead.is_gc() else dead.token) or UNNAMED_SAVE
        return cls(token, uid, this_host(), os.getpid(), time.time(), records=True, collects=collects)

    def is_gc(self) -> bool:
        return self.token.startswith(GC_TOKEN_PREFIX)

    def owns(self, manifest: Manifest) -> bool:
        """Whether `manifest` is the one this claim's save wrote (for gc's claim: the collected save's; one that
        collects `UNNAMED_SAVE` names no token to compare, and owns the manifest it holds, as `stray_claim` reads
        it)."""
        if self.is_gc() and self.collects == UNNAMED_SAVE:
            return True  # a manifest naming no save too: a delete's claim names it so (an earlier version's save)
        if manifest.claim is None:
            return False
        return manifest.claim in {self.token, self.collects if self.is_gc() else ""}

    @classmethod
    def parse(cls, data: bytes) -> Claim | None:
        """The claim a marker holds; None for an empty or foreign marker (an earlier version wrote b""), or one
        holding a number no claim of ours holds: a `pid` of `1e999` (parsed as infinity) failed gc and every save
        of the id with a bare OverflowError, and a `created` of NaN or infinity never aged past `STALE_CLAIM_S`.
        JSON nested deeper than the parser recurses (a RecursionError) is no claim either: a crafted 10 KB
        marker failed the whole gc pass."""
        try:
            d = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
            created = float(d["created"])
            if not math.isfinite(created):
                return None
            claim = cls(str(d["token"]), str(d["uid"]), str(d["host"]), int(d["pid"]), created)
            flag = {name: d.get(name) is True for name in ("tags", "records", "took_over")}
            collects = gc_collects(d) if isinstance(d, dict) else ""
            return dataclasses.replace(
                claim, tags=flag["tags"], records=flag["records"], took_over=flag["took_over"], collects=collects
            )
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
            return None

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, allow_nan=False).encode("utf-8")

    def describe(self) -> str:
        age = time.time() - self.created
        gc = (
            "a delete (or a move) of the checkpoint, or gc of what a dead save left, under way"
            if self.collects
            else "a delete (or a move) of the checkpoint, under way"
        )
        who = gc if self.is_gc() else f"job {self.uid or '?'}"
        return f"claim {self.token!r} of {who}, pid {self.pid} on host {self.host}, {age:.0f}s old"


def compares_atomically(storage: ConditionalStorage, path: Path) -> bool:
    """Whether `storage` compares the marker at `path` with a version and replaces or deletes it in one step
    (a store that does not say so is taken to: the conditional-write protocol promises it)."""
    check = getattr(storage, "compares_atomically", None)
    return True if check is None else bool(check(path))


def no_conditional_delete(url: str, marker_url: str) -> str:
    """Why another save's claim at `marker_url` is not taken over or deleted on this store, and the fix."""
    return (
        f"this store cannot replace or delete {marker_url} only if it is still the version judged (no conditional "
        f"delete): done as a compare, then a delete, two processes that judged it at once could both pass the "
        f"compare, and the second delete would remove the claim the first had just made. Delete the prefix by "
        f"hand once no save writes it (`fsspec` rm, or the store's own tool, on {url}/), or save under another id"
    )


def stale_reason(held: Claim | None, mine: Claim) -> str | None:
    """Why a claim on the id is certainly dead (so it may be taken over), or None while it may be live.

    Only what can be proven is trusted: the job's owner lock (or the pid) on this host, or an age no save
    reaches. A claim made on another host is live until it is that old: taking over a live save's claim
    would let two saves write the same keys again.
    """
    # Imported here: the writer process loads only the write path, and discovery brings in the loader.
    from torch_checkpointing.discovery import job_ended_here, owner_alive

    if held is None:
        return "its marker holds no claim (a save by an earlier version, or a marker made by hand)"
    if held.uid and held.uid == mine.uid:
        return "an earlier save of this same job, which has ended (a job's saves run one at a time)"
    age = time.time() - held.created
    if age > STALE_CLAIM_S:
        return f"it is {age / 3600:.1f} h old (> {STALE_CLAIM_S / 3600:.0f} h)"
    if -age > STALE_CLAIM_S:  # it would never age past the limit in time: the id was refused to every save
        return f"it was made {-age / 3600:.1f} h in the future (> {STALE_CLAIM_S / 3600:.0f} h: no clock is that far)"
    if not same_host(held.host, mine.host):
        return None
    if held.pid == os.getpid() and held.uid and job_ended_here(held.uid):
        return f"it was made in this process by job {held.uid}, whose managers here have all closed"
    alive = owner_alive(held.uid) if held.uid else None
    if held.is_gc() and held.uid and alive is not True:  # the pass held its lock before it made the claim
        return f"the gc pass that made it is over (its lock {held.uid} is held no more)"
    if alive is False:
        return f"no process of job {held.uid} holds its owner lock on this host any more"
    if alive is None and not pid_alive(held.pid):
        return f"its process {held.pid} is gone"
    return None


# ------------------------------------------------------------------------------------------------ the commit


class Commit:
    """One rank's side of one checkpoint's commit. Rank 0 (or the only rank) calls `publish`."""

    def __init__(self, storage: Storage, target: CommitTarget) -> None:
        self.storage = storage
        self.target = target
        self.renames = storage.atomic_rename
        self._manifest_bytes: bytes | None = None  # what `publish` commits, once it got that far
        # The local files this process created under the root, by path: (st_dev, st_ino, size once closed).
        self._own: dict[str, tuple[int, int, int | None]] = {}
        # Whether other processes (the other ranks) also write under the root: files this one did not record
        # may then be theirs. False (one rank): a file it did not record is another program's, left alone.
        self.others_write = True
        # Whether a read that would tell if this save committed failed (told once, at WARNING): the save's
        # report then says it may have been committed, not "nothing was committed there".
        self.outcome_unknown = False

    def is_committed(self) -> bool:
        """Whether the id now holds this save: its manifest is the one `publish` wrote and no marker is left
        (asked after a failure or an interrupt, which can land after the swap, while the replaced copy is
        removed)."""
        if self._manifest_bytes is None or not self._visible(self._manifest_bytes):
            return False
        marker = Path(self.target.final) / INCOMPLETE_MARKER
        try:
            if not self.storage.exists(marker):
                return True
            # Another save's claim that appeared beside it since (see `stray_claim`) does not undo the commit.
            return stray_claim(self.storage.read(marker), Manifest.from_json(self._manifest_bytes))
        except Exception as exc:  # cannot tell: not committed, so the save reports a failure, and says why
            self._tell_unknown(marker, exc)
            return False

    def own(self, path: Path, identity: tuple[int, int], size: int | None = None) -> None:
        """Record a file this save created (its size once it is complete), for `discard`."""
        self._own[os.path.abspath(path)] = (*identity, size)

    @property
    def root(self) -> Path:
        """Where this save's files go: the temporary directory, or the final prefix on object stores."""
        return Path(self.target.tmp if self.renames else self.target.final)

    @property
    def _claims(self) -> ConditionalStorage | None:
        """The storage as one that can claim an id, where this save writes straight under the id."""
        return None if self.renames or not isinstance(self.storage, ConditionalStorage) else self.storage

    def _make_root(self) -> None:
        """Create the temporary directory, and no directory above it: those are made (and recorded, to go again
        with a failed save) by rank 0 alone, when the ranks agree to save (`make_parents`). Created here as well,
        by every rank, they were recorded nowhere and outlived the save that failed: on a rank whose disk is not
        rank 0's, or once rank 0 had removed them. A parent missing here is that rank's doing, named."""
        self._mkdir_one(self.root)

    def make_directory(self, path: Path) -> None:
        """A directory below the root for this save's files, made one level at a time from the root, which must
        still be there: a recursive mkdir re-created the root (and the id's parents) that rank 0 had removed,
        the save having failed, and left them there, without the marker that tells gc they are ours."""
        here = self.root
        for part in path.relative_to(self.root).parts:
            here = here / part
            self._mkdir_one(here)

    def _mkdir_one(self, path: Path) -> None:
        """`path` created, not its parent (on every store: an fsspec `file://` root has real directories too; an
        object store's prefix needs none); a missing parent is named."""
        try:
            self.storage.mkdir(path, recursive=False)
        except FileNotFoundError:
            raise CommitError(
                f"Checkpoint {self.target.final} was not saved: {path.parent}, which the save's rank 0 created or "
                f"found for it, is not there on this rank: removed since (by rank 0, the save having failed there, or "
                f"by another program), or this rank writes to another disk. Every rank must write to storage the "
                f"committing rank reads: a shared filesystem or an object store (FsspecStorageConfig), not a "
                f"node-local disk."
            ) from None

    def begin(self, rank: int = 0, names: Iterable[str] = ()) -> None:
        """Create the root with the marker in it: until `publish`, nothing here reads as a checkpoint.

        Under the final id (object stores) the marker is this save's claim, made before its first upload:
        the data files of two saves of one id share keys, so the second one must write nothing at all. On a
        store whose uploads cannot name their save, this rank then records `names` (the files it is about to
        write, relative to the root), so that a cleanup removes those and leaves what others put there.
        """
        self._make_root()
        claims = self._claims
        if claims is None:
            self.storage.write(self.root / INCOMPLETE_MARKER, b"")
            return
        # Before the claim, and so before the first upload: each names this save, and the claim says they do.
        tags = isinstance(self.storage, TaggedStorage) and self.storage.own_writes(self.root, self._token)
        created = self._claim(claims, dataclasses.replace(Claim.of(self.target), tags=tags, records=not tags))
        if self.storage.exists(self.root / MANIFEST_FILE_NAME):
            # Another save committed (and removed its marker) after this one's checks of the id.
            if created:
                self._release(claims)
            raise CommitError(
                f"Refusing to save to {self._url}: another save committed a checkpoint there while this one was "
                f"starting; this save wrote nothing. Save under another id."
            )
        if not tags:
            record = {"token": self._token, "rank": rank, "files": sorted(set(names))}
            self.storage.write(
                self.root / record_name(self._token, rank), json.dumps(record, allow_nan=False).encode("utf-8")
            )

    @property
    def _token(self) -> str:
        return Path(self.target.tmp).name

    @property
    def _url(self) -> str:
        """The checkpoint as messages name it (`shown_name`): an object store's URL, a local path as given."""
        return shown_name(self.storage, self.target.final)

    def _claim(self, claims: ConditionalStorage, mine: Claim) -> bool:
        """Hold the marker with this save's token; True if this rank created it (False: another rank of this
        save did, or a dead save's claim was taken over). A live claim of another save is a CommitError.

        A claim that looks live is watched for `_CLAIM_WAIT_S` first: on a job spread over hosts, the rank
        that can prove it dead (the one on the dead job's host) may be taking it over for this save.
        """
        marker = self.root / INCOMPLETE_MARKER
        deadline = time.monotonic() + _CLAIM_WAIT_S
        for _ in range(_CLAIM_ATTEMPTS):
            while True:
                if claims.create_object(marker, mine.to_bytes()):
                    return True
                found = claims.read_object(marker)
                if found is None:
                    break  # released meanwhile: create it again
                if not our_marker(found[0]):
                    raise self._foreign(found[0])
                held = Claim.parse(found[0])
                if held is not None and held.token == mine.token:
                    return False
                why = stale_reason(held, mine)
                if why is not None:
                    if self._take_over(claims, marker, found[1], mine, held, why):
                        return False
                    break  # changed meanwhile
                if time.monotonic() >= deadline:
                    assert held is not None
                    raise self._refusal(held)
                time.sleep(_CLAIM_POLL_S)
        raise CommitError(
            f"Refusing to save to {self._url}: its {INCOMPLETE_MARKER} marker kept changing while this save tried "
            f"to claim the id ({_CLAIM_ATTEMPTS} attempts): other saves of this id are starting. Save under "
            f"another id."
        )

    def _foreign(self, marker: bytes) -> CommitError:
        """Another program's `.incomplete` (a download tool's progress): the prefix is not ours to write or clean."""
        return CommitError(
            f"Refusing to save to {self._url}: its {INCOMPLETE_MARKER} is not a marker of ours (it holds "
            f"{marker[:40]!r}{'...' if len(marker) > 40 else ''}), so the prefix is another program's; saving would "
            f"write among its files, and a failed save would delete them. Choose another id."
        )

    def _refusal(self, held: Claim) -> CommitError:
        return CommitError(
            f"Refusing to save to {self._url}: another save is writing it ({held.describe()}). Two saves of one "
            f"id would overwrite each other's files. Save under another id; or, if that save is no longer "
            f"running, delete what it left: `aws s3 rm --recursive {self._url}/` (or FsspecStorage.rmdir), then "
            f"save again. A claim is taken over by itself once its owner is provably gone (its job's processes "
            f"on this host) or it is older than {STALE_CLAIM_S / 3600:.0f} h."
        )

    def _take_over(
        self, claims: ConditionalStorage, marker: Path, etag: str, mine: Claim, held: Claim | None, why: str
    ) -> bool:
        """Replace a dead save's claim, only if it is still the version judged; False if it changed meanwhile."""
        if not compares_atomically(claims, marker):
            raise CommitError(
                f"Refusing to save to {self._url}: its {INCOMPLETE_MARKER} holds the claim of a save that is gone "
                f"({held.describe() if held is not None else 'no claim'}: {why}), and "
                f"{no_conditional_delete(self._url, shown_name(self.storage, str(marker)))}."
            )
        if not claims.replace_object(marker, dataclasses.replace(mine, took_over=True).to_bytes(), etag):
            return False
        logger.warning(
            "Checkpoint save of %s took over the claim of a save that is gone (%s: %s); its files are overwritten, "
            "or removed at the commit (those it recorded or tagged as its own).",
            self._url,
            held.describe() if held is not None else "no claim",
            why,
        )
        return True

    def _manifest_of_ours(self) -> Manifest | None:
        """The manifest this save wrote (its files are this save's), if it got that far."""
        return None if self._manifest_bytes is None else Manifest.from_json(self._manifest_bytes.decode("utf-8"))

    def _let_go(self, claims: ConditionalStorage, etag: str, uploads: list[tuple[str, str]]) -> None:
        """A failed save's last step: its claim goes (only if unchanged), then the uploads listed under it."""
        if claims.delete_object(self.root / INCOMPLETE_MARKER, etag):
            abort_unfinished(self.storage, self.root, uploads, f"The failed save of {self._url}")

    def _holds_claim(self, claims: ConditionalStorage) -> tuple[Claim | None, str | None]:
        """The claim in the marker now and, when it is this save's, the marker's ETag."""
        found = claims.read_object(self.root / INCOMPLETE_MARKER)
        held = Claim.parse(found[0]) if found is not None else None
        ours = found is not None and held is not None and held.token == Path(self.target.tmp).name
        return held, found[1] if ours and found is not None else None

    def _check_claim(self) -> Claim | None:
        """Right before the commit: the id must still be this save's (a restart may have judged it dead). Returns
        the claim held (None where the marker is no claim: a save that renames)."""
        claims = self._claims
        if claims is None:
            return None
        held, etag = self._holds_claim(claims)
        if etag is None:
            whose = held.describe() if held is not None else "no claim: the marker is gone"
            raise CommitError(
                f"Checkpoint {self._url} was not committed: this save no longer holds the id ({whose}); another "
                f"save took it over, and its files are left to it. Save under another id."
            )
        return held

    def _release(self, claims: ConditionalStorage) -> None:
        _, etag = self._holds_claim(claims)
        if etag is not None:
            claims.delete_object(self.root / INCOMPLETE_MARKER, etag)

    def publish(
        self,
        manifest: Manifest,
        metadata_json: str | None,
        still_wanted: Callable[[], None],
        before_writing: Callable[[str], None] | None = None,
    ) -> None:
        """Write metadata and manifest and make the checkpoint visible. Errors before that point propagate.

        `still_wanted` raises when the save must not commit after all (its trainer is gone); it runs last,
        right before the step that makes the checkpoint visible. `before_writing` gets the manifest's digest
        (`manifest_digest`) before anything of it is written: whoever finishes for a writer that dies from then on
        can tell this save's manifest from any other (`adopt`).
        """
        if self._claims is not None:  # the marker is this save's claim: the manifest names it (`stray_claim`)
            manifest = dataclasses.replace(manifest, claim=Path(self.target.tmp).name)
        self._check_visible(manifest)
        root = self.root
        manifest_bytes = self._manifest_bytes = manifest.to_json().encode("utf-8")
        if before_writing is not None:
            before_writing(manifest_digest(manifest_bytes))
        if metadata_json is not None:
            self.storage.write(root / METADATA_FILE_NAME, metadata_json.encode("utf-8"))
        if self.renames:
            self.storage.write(root / MANIFEST_FILE_NAME, manifest_bytes)
            self.storage.delete(root / INCOMPLETE_MARKER)
            self.storage.sync_directory(root)
            # Checked again after the fsyncs, not before: whatever appeared at the id meanwhile is looked at.
            replacing = check_target(self.storage, self.target.final, self.target.overwrite)
            still_wanted()
            # A signal handler's exception (a preemption handler's sys.exit()) landing between the swap and the
            # removal of the replaced copy left that copy beside the id; its handler runs once both are done.
            with signals_deferred(f"committing {self.target.final}", quiet=True):
                self._swap(manifest_bytes, replacing)
                self._sync_parent()
            return
        else:
            # Here the id is the root itself. The manifest goes first and the marker last (the commit): a crash
            # in between leaves both, which readers take as incomplete and gc collects as ours (marker first
            # would leave neither: nothing to recognise, and the id refused to every later save).
            check_target(self.storage, self.target.final, self.target.overwrite)
            held = self._check_claim()
            self._clear_taken_over(held, manifest, metadata_json is not None)
            still_wanted()
            self._write_manifest(manifest_bytes)
            self._drop_records()
            self._remove_claim()
        self._sync_parent()

    def _write_manifest(self, manifest_bytes: bytes) -> None:
        """The manifest's conditional create. One whose answer was lost (a dropped connection) and that the
        client retried met its own manifest: "it already exists, another save committed" for this very save.
        The manifest names this save's claim token, so bytes equal to ours in the store are ours. Said at WARNING
        by the error's kind alone: its words ("another save committed ...; this save was not committed") are
        not true of this save, and were logged as they were."""
        try:
            self.storage.write(self.root / MANIFEST_FILE_NAME, manifest_bytes)
        except Exception as exc:
            if not self._visible(manifest_bytes):
                raise
            log_safely(
                logger,
                logging.WARNING,
                "The upload of the manifest of %s failed (%s), but the manifest in the store is this save's (the "
                "store did the upload and its answer was lost; the client's retry met the manifest): the save is "
                "committed.",
                self._url,
                type(exc).__name__,
            )

    def _clear_taken_over(self, held: Claim | None, manifest: Manifest, wrote_metadata: bool) -> None:
        """Before the manifest: the files of the dead saves whose claims this one took over, but for the names
        this save wrote over. Every rank has finished writing (a rank that removed them at its takeover deleted
        what the other ranks of this save were writing at the same names). Named at WARNING."""
        if held is None or not held.took_over:  # no dead save's claim was taken over: nothing of another save here
            return
        # Every rank has completed its uploads: what is still unfinished under the id is the dead saves'.
        abort_unfinished(self.storage, self.root, unfinished_uploads(self.storage, self.root), self._url)
        kept = {posixpath.normpath(rec.path) for rec in manifest.files} | {MANIFEST_FILE_NAME, INCOMPLETE_MARKER}
        kept |= {METADATA_FILE_NAME} if wrote_metadata else set()
        if held.records:
            removed = _remove_taken_over(self.storage, self.root, self._token, kept)
        elif isinstance(self.storage, TaggedStorage):
            removed = self._remove_untracked_uploads(self.storage, kept)
        else:
            return
        if removed:
            log_safely(
                logger,
                logging.WARNING,
                "Checkpoint save of %s removed %d file(s) that the save whose claim it took over had written and "
                "this one does not: %s%s",
                self._url,
                len(removed),
                ", ".join(f"{self._url}/{rel}" for rel in removed[:_SHOWN]),
                " ..." if len(removed) > _SHOWN else "",
            )

    def _remove_untracked_uploads(self, storage: TaggedStorage, kept: set[str]) -> list[str]:
        """On a store that tags uploads: the objects saves of ours wrote here under another token (the dead
        saves'), each only if unchanged since its HEAD; a user's (untagged) object stays. One HEAD per object,
        paid only by a save that took a claim over."""
        by_save = storage.objects_by_save(self.root)
        if by_save is None:
            return []
        dead = {rel: seen for rel, seen in by_save[0].items() if seen[0] != self._token and rel not in kept}
        changed = set(remove_saves_objects(storage, self.root, dead))
        return sorted(set(dead) - changed - {INCOMPLETE_MARKER})

    def _drop_records(self) -> None:
        """This save's records of the names its ranks wrote, once its manifest lists them: the marker goes after
        them, so a committed checkpoint holds none, and a crash in between leaves the manifest to name the files."""
        _delete_all(self.storage, self.root, _records_of(self.storage, self.root, self._token))

    def _remove_claim(self) -> None:
        """The commit on an object store: its marker removed. A DELETE that failed on the way back (a dropped
        connection, a 5xx once the store had acted) may have removed it: then the checkpoint is committed, and
        the save must not report a failure (every rank raised, and a retry was refused: "a checkpoint already
        exists there") for a checkpoint that loads."""
        try:
            self.storage.delete(self.root / INCOMPLETE_MARKER)
        except Exception as exc:
            if not self.is_committed():
                raise
            log_safely(
                logger,
                logging.WARNING,
                "Checkpoint %s is committed: the removal of its %s marker answered %s: %s, but the marker is gone.",
                self._url,
                INCOMPLETE_MARKER,
                type(exc).__name__,
                exc,
            )

    def _sync_parent(self) -> None:
        self._after_commit(lambda: self.storage.sync_directory(Path(self.target.final).parent), "sync its parent")

    def _check_visible(self, manifest: Manifest) -> None:
        """Refuse to vouch for files this rank cannot see at their recorded size (one stat/HEAD per file).

        Ranks on machines without a shared filesystem (each writing to its own local disk) report files that
        never reach the committing rank; a manifest over them would publish a checkpoint nobody can load.
        """
        unseen: dict[int, list[str]] = {}
        for rec in manifest.files:
            try:
                size: int | None = self.storage.getsize(self.root / rec.path)
            except FileNotFoundError:
                size = None
            if size != rec.size:
                unseen.setdefault(rec.rank, []).append(rec.path)
        if unseen:
            raise CommitError(
                f"Checkpoint {self._url} was not committed: the committing rank cannot see the files of "
                f"rank(s) {sorted(unseen)} ({_listing([p for paths in unseen.values() for p in paths])}). Every "
                f"rank must write to storage the committing rank reads: a shared filesystem or an object store "
                f"(FsspecStorageConfig), not a node-local disk.",
                {rank: f"files not visible to the committing rank: {paths}" for rank, paths in unseen.items()},
            )

    def _swap(self, manifest_bytes: bytes, replacing: bool) -> None:
        """Exchange with what the check approved; onto an id the check found empty, only a plain rename.

        The rename refuses a directory that another program (or a racing save) filled since the check, where an
        exchange would have swapped it out and deleted it.
        """
        final, tmp = Path(self.target.final), Path(self.target.tmp)
        try:
            if replacing:
                self.storage.replace_directory(tmp, final)
            else:
                self.storage.rename(tmp, final, is_directory=True)
        except BaseException as exc:
            if not self._visible(manifest_bytes):
                if isinstance(exc, OSError) and exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise CommitError(
                        f"Checkpoint {final} was not committed: a non-empty directory appeared at {final} while "
                        f"this save committed (another save of the same id, or another program); it was left as "
                        f"it is. Save to another id, or retry once it is gone."
                    ) from exc
                raise
            self._warn_left_behind(exc)
            if not isinstance(exc, Exception):  # a signal handler's: it ends the save as the handler meant
                raise
        self._remove_replaced()

    def _remove_replaced(self) -> None:
        """After the swap: the checkpoint it replaced, which an atomic exchange left at this save's temporary name."""
        final, tmp = Path(self.target.final), Path(self.target.tmp)
        if self.storage.exists(tmp):
            gc = f"`torch-checkpointing gc {final.parent}` removes it once this process is gone, or delete it by hand"
            self._after_commit(lambda: self.storage.rmdir(tmp), f"remove the replaced checkpoint at {tmp} ({gc})")

    def adopt(self, digest: str | None, writer_pid: int | None = None) -> bool:
        """(Rank 0's trainer, for its writer process that died in `publish`.) Whether the id holds this save, whose
        manifest's digest is `digest` (None: the writer died before it had one). If it does, what the writer had left
        is done here (the replaced checkpoint's removal, the parent's fsync); if not, what the save wrote is removed
        (`discard`), and an earlier checkpoint at the id is untouched.

        A killed writer's last rename has either happened or not by the time its trainer learns that it died (an
        object store's request already sent can still land, the store's own business), so what the id holds then is
        the outcome; without this the trainer could only say that it did not know, and the other ranks waited the
        save's whole timeout for rank 0's answer to the commit step.

        `writer_pid`, the dead writer's: on a filesystem without an atomic exchange its replace moved the replaced
        checkpoint aside (`.old_<id>_<pid>-<nonce>`) first. Committed, that copy is removed here; not committed
        (killed between the two renames: nothing at the id), it is put back under the id. Before, the first was
        left beside the id, and the second said "an earlier checkpoint at that id is intact" while a load of the id
        found nothing until someone ran gc.
        """
        found = self._manifest_at_the_id()
        self._manifest_bytes = found if found is not None and manifest_digest(found) == digest else None
        if self._manifest_bytes is None or not self._marker_gone():
            self.discard()
            if self.renames and writer_pid is not None:
                self._put_back_aside(writer_pid)
            return False
        if self.renames:
            self._remove_replaced()
            for aside in self._asides_of(writer_pid):
                self._after_commit(functools.partial(self.storage.rmdir, aside), f"remove the replaced copy {aside}")
        self._sync_parent()
        return True

    def _asides_of(self, pid: int | None) -> list[Path]:
        """The copies of the id that process `pid`'s replace (the fallback without an exchange) moved aside."""
        # Imported here: the writer process loads only the write path, and asides bring in discovery.
        from torch_checkpointing.asides import copies_aside, made_by

        if pid is None or not self.renames:
            return []
        try:
            found = copies_aside(self.storage, Path(self.target.final))
        except Exception as exc:
            self._cannot_list(pid, exc)
            return []
        return [c for c in found if made_by(c, pid)]

    def _cannot_list(self, pid: int, exc: Exception) -> None:
        final = Path(self.target.final)
        log_safely(
            logger,
            logging.WARNING,
            "Cannot list %s for what the dead writer process %d moved aside from %s (%s: %s); run "
            "`torch-checkpointing gc %s`: it puts back or removes such a copy.",
            final.parent,
            pid,
            final,
            type(exc).__name__,
            exc,
            final.parent,
        )

    def _put_back_aside(self, pid: int) -> None:
        """The dead writer was killed between its two renames: the id holds nothing and the replaced checkpoint is
        aside. It goes back under the id when `asides.copy_to_put_back` (gc's rule too) chooses it; otherwise, or
        when the rename fails, a WARNING names what is aside and how to get it back."""
        from torch_checkpointing.asides import copy_to_put_back  # not on the write path: see `_asides_of`

        final = Path(self.target.final)
        try:
            put_back = copy_to_put_back(self.storage, final, dead_pid=pid)
        except Exception as exc:
            self._cannot_list(pid, exc)
            return
        if put_back.chosen is None:
            if put_back.copies and put_back.id_free:  # an id taken since (another save): gc judges the copies
                log_safely(
                    logger,
                    logging.WARNING,
                    "The checkpoint writer process %d died replacing %s, which holds nothing now; of what is aside "
                    "(%s) nothing can be put back: %s. Run `torch-checkpointing gc %s`.",
                    pid,
                    final,
                    ", ".join(str(a) for a in put_back.copies),
                    put_back.why_not,
                    final.parent,
                )
            return
        aside = put_back.chosen
        try:
            self.storage.rename(aside, final, is_directory=True)
            self.storage.sync_directory(final.parent)
        except Exception as exc:
            log_safely(
                logger,
                logging.WARNING,
                "The checkpoint writer process %d died between moving %s aside to %s and moving its replacement "
                "in, and the trainer could not move it back (%s: %s): the id holds nothing. Run "
                "`torch-checkpointing gc %s` to move it back, or rename it by hand.",
                pid,
                final,
                aside,
                type(exc).__name__,
                exc,
                final.parent,
            )
            return
        log_safely(
            logger,
            logging.WARNING,
            "The checkpoint writer process %d died between moving %s aside to %s and moving its replacement in: "
            "the trainer moved the earlier checkpoint back under its id.",
            pid,
            final,
            aside,
        )

    def _warn_left_behind(self, exc: BaseException) -> None:
        """Name what the interrupted or failed removal of the replaced checkpoint left beside the id, for gc."""
        left = self._left_behind()
        parent = Path(self.target.final).parent
        log_safely(
            logger,
            logging.WARNING,
            "Checkpoint %s is committed, but the removal of the checkpoint it replaced was stopped (%s: %s); left "
            "beside it: %s. `torch-checkpointing gc %s` removes it once this process is gone (or delete it by hand).",
            self.target.final,
            type(exc).__name__,
            exc,
            ", ".join(left) or "nothing",
            parent,
        )

    def _left_behind(self) -> list[str]:
        """This process's hidden copies of the replaced checkpoint: the swapped-out temporary, or its aside."""
        final, tmp = Path(self.target.final), Path(self.target.tmp)
        try:
            names = self.storage.ls(final.parent)
        except Exception:
            return [str(tmp)]
        mine = (
            m for n in names if (m := ASIDE_RE.match(n)) is not None and int(m["pid"]) == os.getpid() and made_here(m)
        )
        asides = [m.string for m in mine if aside_of(m.string, [final.name]) == final.name]
        return [str(final.parent / n) for n in sorted(asides + [tmp.name] * (tmp.name in names))]

    def _manifest_at_the_id(self) -> bytes | None:
        """The manifest at the id; None when there is none. One that cannot be read is no answer: taken for
        "none there", a dead writer's save that was in place was reported NOT committed (and its id loaded it)."""
        path = Path(self.target.final) / MANIFEST_FILE_NAME
        try:
            return self.storage.read(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Exception as exc:
            raise self._cannot_tell(path, exc) from exc

    def _marker_gone(self) -> bool:
        """`is_committed`'s marker check, for `adopt`: a storage that cannot answer leaves the outcome unknown."""
        marker = Path(self.target.final) / INCOMPLETE_MARKER
        try:
            if not self.storage.exists(marker):
                return True
            assert self._manifest_bytes is not None
            return stray_claim(self.storage.read(marker), Manifest.from_json(self._manifest_bytes))
        except Exception as exc:
            raise self._cannot_tell(marker, exc) from exc

    def _cannot_tell(self, path: Path, exc: Exception) -> CommitOutcomeUnknownError:
        return CommitOutcomeUnknownError(
            f"Whether checkpoint {self._url} was committed by its dead writer is not known: reading "
            f"{self._named(path)} failed ({type(exc).__name__}: {exc}). Nothing at the id was changed; the id holds "
            f"its previous checkpoint or this one, whole. Load it to check, or save again."
        )

    def _visible(self, manifest_bytes: bytes) -> bool:
        """Whether the manifest at the id is this save's. No manifest there: no. One the store would not read:
        no as well (the save reports a failure), told at WARNING, since the id may hold this save after all."""
        path = Path(self.target.final) / MANIFEST_FILE_NAME
        try:
            return self.storage.read(path) == manifest_bytes
        except (FileNotFoundError, NotADirectoryError):
            return False
        except Exception as exc:
            self._tell_unknown(path, exc)
            return False

    def _tell_unknown(self, path: Path, exc: Exception) -> None:
        """The WARNING of a read that left a failed save's commit unknown: before, the read's error was dropped
        and the save reported NOT committed, while the id may hold it whole. Told once per save."""
        if self.outcome_unknown:
            return
        self.outcome_unknown = True
        log_safely(
            logger,
            logging.WARNING,
            "Could not tell whether checkpoint %s was committed: reading %s failed (%s: %s). The save fails, but "
            "the id may hold it, whole; load it to check, or save again.",
            self._url,
            self._named(path),
            type(exc).__name__,
            exc,
        )

    def _after_commit(self, action: Callable[[], None], what: str) -> None:
        """Run a step after the commit: its failure is a WARNING; a signal handler's exception is raised too."""
        try:
            action()
        except BaseException as exc:
            log_safely(
                logger,
                logging.WARNING,
                "Checkpoint %s is committed, but could not %s: %s: %s",
                self.target.final,
                what,
                type(exc).__name__,
                exc,
            )
            if not isinstance(exc, Exception):
                raise

    def discard(self) -> None:
        """Remove what this save wrote (never a committed checkpoint); a failure is only logged."""
        root = self.root
        try:
            claims = self._claims
            if claims is not None:
                self._discard_claimed(claims)
            elif self.storage.exists(root) and not (
                not self.renames and self.storage.exists(root / MANIFEST_FILE_NAME)
            ):
                self._remove_root()
            remove_made(self.target.made)
        except BaseException as exc:  # an interrupt too (a Ctrl-C sent again): what it left is named
            log_safely(
                logger,
                logging.WARNING,
                "Could not remove the unfinished save at %s: %s: %s. Delete it by hand, or run "
                "`torch-checkpointing gc %s` (it removes what dead saves left there).",
                self._named(root),
                type(exc).__name__,
                exc,
                self._named(root.parent),
            )
            if not isinstance(exc, Exception):
                raise

    def _remove_root(self) -> None:
        """The unfinished root, but only what this save created: a file it wrote that another program replaced
        since (another inode or size), or one it never wrote, stays, and so do the directories holding it.

        (Before, the whole root went, whatever someone had put at the save's file names meanwhile.)
        """
        local = self.storage.local_path(self.root) if self._own else None
        # Nothing recorded (the trainer cleaning up after its writer), or a link put in its place: `rmdir`
        # refuses a link, never walking the folder it points to.
        if local is None or not self.renames or os.path.islink(local):
            self.storage.rmdir(self.root)
            return
        local = os.path.abspath(local)  # as `own` recorded them: a relative id's paths are relative
        left = self._remove_own_files(local)
        if not left:
            remove_tree_marks_last(local)
            return
        logger.warning(
            "The unfinished save at %s was not removed whole: %s not created by this save (replaced or added since "
            "by another program), so %s left there with the directory. Move what you need out of %s, then "
            "delete it (or run `torch-checkpointing gc %s`).",
            local,
            ", ".join(left[:_SHOWN]) + (f" and {len(left) - _SHOWN} more" if len(left) > _SHOWN else ""),
            "they are" if len(left) > 1 else "it is",
            local,
            os.path.dirname(local),
        )

    def _remove_own_files(self, local: str) -> list[str]:
        """Remove, bottom-up, the files this save created and the directories left empty; return the others."""
        left: list[str] = []
        # The engine's own files at the root (marker, metadata, manifest), written with `storage.write`, which
        # records nothing: in the save's own directory their names say whose they are.
        marks = {os.path.join(local, name) for name in RESERVED_FILE_NAMES}
        for dirpath, dirnames, filenames in os.walk(local, topdown=False, onerror=raise_unless_removed):
            for name in filenames + dirnames:
                full = os.path.join(dirpath, name)
                st = os.lstat(full)
                if stat.S_ISDIR(st.st_mode):
                    with contextlib.suppress(OSError):  # not empty: it holds what is left
                        os.rmdir(full)
                elif full in marks:
                    continue  # removed last, with the root (`remove_tree_marks_last`), when nothing is left
                elif self._created(full, st):
                    os.unlink(full)
                else:
                    left.append(os.path.relpath(full, local))
        return sorted(left)

    def _created(self, path: str, st: os.stat_result) -> bool:
        """Whether `path` is a file this save created and still the same one (inode, and size once complete)."""
        mine = self._own.get(path)
        if mine is None:
            return self.others_write and path != self.target.tmp and stat.S_ISREG(st.st_mode)
        dev, ino, size = mine
        return (st.st_dev, st.st_ino) == (dev, ino) and size in (None, st.st_size)

    def _named(self, path: Path) -> str:
        """`path` as the store names it (an object store's URL: an id relative to its `url` root, or a `Path` that
        folded `s3://` into `s3:/`, is no name `aws s3` or `torch-checkpointing gc` takes)."""
        try:
            return self.storage.remap_path(path)
        except Exception:  # a message must not fail on a name the store cannot map
            return str(path)

    def _keep_untold(self, root: Path) -> None:
        """This save's claim says the store records which save wrote each object, but it lists no such record
        under the id: nothing tells the save's files from those others put there while it ran. They all stay, and
        so does the claim, dead once this process is gone, for gc (which keeps such a prefix whole and names its
        files: `retention._not_told_apart`). Before, every object under the id but the marker was deleted."""
        left = [rel for rel in _walk(self.storage, root) if not rel.endswith("/") and rel != INCOMPLETE_MARKER]
        shown = ", ".join(left[:_SHOWN]) + (" ..." if len(left) > _SHOWN else "")
        log_safely(
            logger,
            logging.WARNING,
            "The failed save of %s left its files in place: this store lists no record of which save wrote each "
            "object, so they cannot be told apart from files others put there (%s). Move yours out, then delete "
            "%s by hand.",
            self._url,
            shown or "none",
            self._url,
        )

    def _discard_claimed(self, claims: ConditionalStorage) -> None:
        """Only under this save's own claim: the files first, the marker (the claim) last, and only if unchanged.

        A save refused its claim wrote nothing; removing the prefix would delete the files of the save that
        holds it (or of a checkpoint committed meanwhile).
        """
        root = self.root
        held, etag = self._holds_claim(claims)
        if etag is None:
            if held is not None:
                logger.info("Not removing %s: it is claimed by another save (%s)", self._url, held.describe())
            return
        uploads = unfinished_uploads(self.storage, root)  # this save's and dead ones': this save holds the claim
        # Beside this save's own claim, a manifest not this save's is left; this save's own (the commit failed at
        # its last step, the marker's removal) goes with the files below, after those it lists (`remove_recorded`):
        # its records are gone by then, and deleted first, a kill before the files left them named by nothing, to
        # gc "not written by this save", the id refused to every later save.
        if self.storage.exists(root / MANIFEST_FILE_NAME) and (
            self._manifest_bytes is None or not self._visible(self._manifest_bytes)
        ):
            return
        if held is not None and held.records:  # no tags, but its ranks recorded what they write
            left = remove_recorded(self.storage, root, self._manifest_of_ours())
            self._let_go(claims, etag, uploads)
            warn_left_in_place(self._url, left, f"The failed save of {self._url}")
            return
        tagged = self.storage if isinstance(self.storage, TaggedStorage) else None
        by_save = tagged.objects_by_save(root) if tagged is not None else None
        if tagged is None or by_save is None:
            self._keep_untold(root)
            return
        ours, others = by_save  # saves of ours that wrote here hold the claim no more: this one holds it
        changed = remove_saves_objects(tagged, root, ours)
        self._let_go(claims, etag, uploads)
        warn_left_in_place(self._url, [*others, *changed], f"The failed save of {self._url}")
