"""Finding checkpoints: what is committed under a root, which one is newest, and what a killed save left behind.

Everything here reads manifests only (never item files), so listing a root of large checkpoints is cheap. A
directory counts as a committed checkpoint of ours exactly when `read_manifest` accepts it: it has our manifest
and no `.incomplete` marker. Everything else under the root is either a leftover of ours (recognised by the
names the engine gives its temporary directories) or not ours, and then it is never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import math
import os
import re
import stat
import tempfile
import threading
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch_checkpointing.checkpoint_layout import LayoutInfo
from torch_checkpointing.config import home_expanded, literal_tilde, refuse_unencodable
from torch_checkpointing.errors import (
    CheckpointError,
    CheckpointReplacedError,
    ConfigError,
    ConfigTypeError,
    CorruptCheckpointError,
    ForeignManifestError,
    IncompleteCheckpointError,
    MissingItemError,
    NewerCheckpointError,
    ObjectStoreError,
    TemplateMismatchError,
    on_another,
    raise_if_short_of_resources,
)
from torch_checkpointing.futures import WorkerPool
from torch_checkpointing.manifest import (
    INCOMPLETE_MARKER,
    MANIFEST_FILE_NAME,
    Manifest,
    check_formats_known,
    our_marker,
    parse_manifest,
    read_bounded,
    read_manifest,
    read_marker,
    shown_name,
    what_to_pass_instead,
)
from torch_checkpointing.names import (
    ASIDE_RE,
    CLOCK_PROBE_RE,
    TMP_RE,
    TRASH_RE,
    aside_of,
    held_here,
    made_here,
    pid_alive,
    previous_copy_hint,
    step_from_name,
)
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy
from torch_checkpointing.storage import LOCAL_SCHEMES, fsspec_storage_for, local_path_of
from torch_checkpointing.storage.base_storage import Storage, StorageConfig, clock_probe_running, local_store_now
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import url_scheme

__all__ = [
    "CheckpointInfo",
    "Leftover",
    "Listing",
    "OwnerLock",
    "PassedOver",
    "Problem",
    "checkpoint_info",
    "committed_manifest",
    "current_resume_point",
    "damage",
    "latest_checkpoint",
    "list_checkpoints",
    "list_leftovers",
    "listing",
    "newest_intact",
    "problem_with",
    "require_directory",
    "require_path",
    "require_path_type",
    "resume_point",
    "self_describing_layouts",
    "still_there",
    "storage_of",
    "user_path",
    "warn_if_a_checkpoint",
]

logger = logging.getLogger(__name__)

LeftoverKind = Literal["temporary", "replaced", "trash", "incomplete", "claim", "probe"]

# The latest datetime can show (9999-12-31); a commit time past it, or not finite, is a crafted manifest.
_MAX_COMMIT_TIME = 253402300799.0


def default_storage() -> Storage:
    """The local filesystem, buffered (no direct I/O: tools read small manifests)."""
    return LocalFileSystemStorageConfig(use_direct_io=False).create_storage()


def storage_for(where: str | os.PathLike[str]) -> Storage:
    """The storage a root or checkpoint path names when the caller passes none: for a URL (`s3://bucket/run`)
    its object store, configured from the environment as a manager built without a storage config picks it;
    else the local filesystem. Before, a URL was looked up as a local path: `latest_checkpoint("s3://b/run")`
    found nothing and a resume started from scratch, without a word."""
    scheme = url_scheme(where)
    if scheme is None:
        return default_storage()
    if scheme in LOCAL_SCHEMES:
        raise local_url_refused(os.fspath(where), scheme)
    return fsspec_storage_for(scheme, os.fspath(where))


def local_url_refused(url: str, scheme: str, lead: str = "") -> ConfigError:
    """The refusal of a `file://` URL where a local path is read, naming the path to pass: the one a manager
    reads for that URL (`local_path_of`: escapes decoded, `localhost` no directory). It was the URL with its
    scheme cut off, so `file:///a/my%20run` suggested `/a/my%20run` and `file://localhost/a` `/localhost/a`."""
    try:
        local = local_path_of(url)
    except ValueError as exc:  # another host's file: no path here names it
        return ConfigError(f"{lead}{exc}")
    return ConfigError(f"{lead}{url!r} is a {scheme}:// URL; pass the local path it names ({local!r}).")


def spelt(path: str | os.PathLike[str], local: bool = True) -> str:
    """`path` as an id: a URL's `scheme://` put back where `Path` folded it, so that a manager built without a
    storage config recognises the store (it read `s3:/b/run/step_5` as a local path). A local path keeps its own
    leading slash (`file:///abs/run`, as `FsspecStorage.url` names it): `file://abs/run` names the host `abs`.
    A relative `local` path under a folder named `~` keeps the `./` that `Path` drops: a save or load reads
    `~/run` as the home directory (a key under an object store's `url` root is no local path: `~/a` stays)."""
    text = os.fspath(path)
    scheme = url_scheme(text)
    if scheme is None:
        return literal_tilde(text) if local else text
    slash = "/" if scheme in LOCAL_SCHEMES else ""
    return f"{text.split(':', 1)[0]}://{slash}{_after_scheme(text)}"


def _after_scheme(url: str) -> str:
    """`s3://b/run` (or `Path`'s `s3:/b/run`) without its scheme and slashes: `b/run`."""
    return url.split(":", 1)[1].lstrip("/")


# What each field of `CheckpointInfo` may be (a bool is no int here).
_INFO_FIELDS: dict[str, tuple[type, ...]] = {
    "path": (str,),
    "step": (int, type(None)),
    "commit_time": (float, int, type(None)),
    "world_size": (int,),
    "total_bytes": (int,),
    "metrics": (dict, type(None)),
    "library_version": (str,),
    "items": (tuple, list),
}


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as its manifest describes it."""

    path: str
    step: int | None
    commit_time: float | None
    world_size: int
    total_bytes: int
    metrics: dict[str, float] | None
    library_version: str
    items: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Refuse a field of the wrong type naming it: a record built by hand (a test double, a listing of one's
        own) took anything, and `name` or `to_dict()` failed later with a bare AttributeError or TypeError."""
        for name, kinds in _INFO_FIELDS.items():
            value = getattr(self, name)
            if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
                wanted = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
                raise ConfigTypeError(
                    f"CheckpointInfo.{name} must be {wanted}, got {type(value).__name__} {value!r:.80}"
                )
        if not all(isinstance(key, str) for key in self.items):
            raise ConfigTypeError(f"CheckpointInfo.items must hold str item keys only, got {self.items!r:.80}")
        object.__setattr__(self, "items", tuple(self.items))  # a list is taken as the tuple the field is

    @property
    def name(self) -> str:
        """The directory's own name, the last part of `path` (`step_100`)."""
        return os.path.basename(self.path.rstrip("/"))

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values, with the directory's `name` after its `path`."""
        fields = dataclasses.asdict(self)
        return {"path": fields.pop("path"), "name": self.name, **fields, "items": list(self.items)}


@dataclass(frozen=True)
class Leftover:
    """A directory a save, a replacement or a deletion left behind; `owner_alive` None when it cannot be told."""

    path: str
    kind: LeftoverKind
    checkpoint_name: str
    owner_alive: bool | None
    total_bytes: int = 0
    detail: str = ""
    # Whether it holds what only the engine leaves there (its manifest or `.incomplete` marker, a live job's
    # owner lock) or nothing at all. A directory that merely has one of our names is somebody's own folder.
    recognised: bool = True
    # A newer engine's committed checkpoint beside an `.incomplete` marker: what the marker means is that
    # engine's to tell, so gc keeps it and says so (before, it was left out of gc's report: only logged).
    newer_engine: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PassedOver:
    """A checkpoint a resume cannot use, and why. `unreadable`: this user may not read one of its files or its
    directory (a `PermissionError`), or a newer engine wrote its manifest, which says nothing about its bytes: no
    damage, and never a reason to delete it. `listed`: whether a listing holds it (one whose manifest cannot be
    read, or is damaged, is in none)."""

    path: str
    problem: str
    unreadable: bool = False
    listed: bool = True

    @property
    def name(self) -> str:
        """The directory's own name, the last part of `path` (`step_100`)."""
        return os.path.basename(self.path.rstrip("/"))

    def to_dict(self) -> dict[str, Any]:
        """`path`, `name`, `problem`, as listings' JSON documents name such a checkpoint."""
        return {"path": self.path, "name": self.name, "problem": self.problem}


@dataclass
class Listing:
    """The committed checkpoints under a root, oldest first, and the entries left out of them (each `PassedOver`,
    not listed): those whose manifest or directory this user may not read, or whose manifest a newer engine
    wrote (`unreadable`), and those whose manifest is damaged. A listing that shows only the first hides the
    others: a damaged newest one made an older one look like the newest, with nothing damaged."""

    checkpoints: list[CheckpointInfo] = dataclasses.field(default_factory=list)
    unlisted: list[PassedOver] = dataclasses.field(default_factory=list)
    # Entries the listing named that were gone when looked at (deleted since: a retention pass, a `prune`)
    went: list[str] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------------------------------------ discovery


def _manifest_or_none(storage: Storage, path: Path, closed: list[PassedOver] | None = None) -> Manifest | None:
    """`_manifest_once`, read again when a save replaced the id while its manifest was read: that is no damage,
    and the id holds a checkpoint (before, it was skipped as damaged, and "latest" went back a step)."""
    for _ in range(_REPLACED_RETRIES - 1):
        try:
            return _manifest_once(storage, path, closed)
        except CheckpointReplacedError as exc:
            logger.debug("%s was replaced while its manifest was read; reading it again: %s", path, exc)
    try:
        return _manifest_once(storage, path, closed)
    except CheckpointReplacedError as exc:
        logger.warning(
            "Skipping %s, replaced by saves again at each of %d reads: %s", spelt(path), _REPLACED_RETRIES, exc
        )
        return None


def _manifest_once(storage: Storage, path: Path, closed: list[PassedOver] | None) -> Manifest | None:
    """The manifest of a committed checkpoint, else None (incomplete, unreadable, or not ours: all skipped).

    A save in flight (the `.incomplete` marker) and somebody else's `manifest.json` are skipped quietly; a
    manifest of ours that cannot be read (truncated, a symlink, a FIFO, a field out of range) is a damaged
    checkpoint that silently dropped out of every listing and "latest": it is skipped with a WARNING. A store
    that failed to answer (`ObjectStoreError`) says nothing about the checkpoint: raised, or "latest" would go
    back a step. One this user may not read, one a newer engine wrote, or a damaged one is appended to `closed`
    (when given) as well as warned about.
    """
    try:
        if not storage.exists(path / MANIFEST_FILE_NAME):
            return None
        return read_manifest(storage, path, "check")
    except ObjectStoreError:
        raise
    except PermissionError as exc:  # a directory this user may not look into: it may well be the newest one
        _warn_unreadable_once(path, exc)
        if closed is not None:
            closed.append(PassedOver(spelt(path), str(exc), unreadable=True, listed=False))
    except IncompleteCheckpointError as exc:  # a save in flight, or another tool's folder (`ForeignManifestError`)
        logger.debug("Skipping %s: %s", path, exc)
    except CheckpointReplacedError:
        raise
    except NewerCheckpointError as exc:  # healthy, for all we know: never "damaged" (an operator deletes those)
        logger.warning("Skipping %s, which a newer engine wrote: %s", spelt(path), exc)
        if closed is not None:  # not loadable here, as one this user may not read: `ls` names it so
            closed.append(PassedOver(spelt(path), str(exc), unreadable=True, listed=False))
    except RuntimeError as exc:
        if not still_there(storage, path / MANIFEST_FILE_NAME):
            logger.debug("Skipping %s: removed while it was read (a deletion in another process): %s", spelt(path), exc)
        else:
            logger.warning("Skipping %s, a damaged checkpoint: %s", spelt(path), exc)
            if closed is not None:
                closed.append(PassedOver(spelt(path), str(exc), listed=False))
    return None


# The closed directories already named in this process: a root's `lost+found`, or another user's folder, is
# named once, not at every retention pass of a long job.
_UNREADABLE_NAMED: set[str] = set()


def _warn_unreadable_once(path: Path, exc: OSError) -> None:
    level = logging.DEBUG if str(path) in _UNREADABLE_NAMED else logging.WARNING
    _UNREADABLE_NAMED.add(str(path))
    logger.log(level, "Skipping %s, which cannot be read: %s", spelt(path), exc)


def still_there(storage: Storage, path: Path) -> bool:
    """Whether something (even a dangling link) is still at `path`: a checkpoint another process deleted
    between our listing and our read is gone, not damaged."""
    local = storage.local_path(path)
    try:
        return os.path.lexists(local) if local is not None else storage.exists(path)
    except OSError:
        return True  # cannot tell: the safe side is to report what was found


def require_directory(storage: Storage, path: Path, what: str, missing: str | None = None) -> None:
    """Raise unless `path` is a directory: FileNotFoundError when nothing is there (saying `missing`, by
    default "<path>: no such directory."), NotADirectoryError (naming what was expected) when it is a file, so
    a user who passed a checkpoint's file learns what to pass."""
    local = storage.local_path(path)
    if local is not None:
        missing = f"{path}: no such directory." if missing is None else missing
        _require_local_directory(storage, path, local, what, missing)  # a save or a deletion may be under way
        return
    if storage.isdir(path):
        return
    shown = shown_name(storage, path)
    if storage.exists(path):
        # Two lookups, not one: on an object store a save of the id may have started between them (its marker
        # makes the prefix). Only a second "no prefix" makes it a file; a prefix now is read (incomplete) as such.
        if storage.isdir(path):
            return
        raise NotADirectoryError(f"{shown} is a file, not a directory: pass {what}")
    raise FileNotFoundError(f"{shown}: no such directory." if missing is None else missing)


def _require_local_directory(storage: Storage, path: Path, local: str, what: str, missing: str) -> None:
    try:
        mode = os.stat(local).st_mode
    except FileNotFoundError:
        from torch_checkpointing.asides import await_replaced  # it lists checkpoints through this module

        await_replaced(storage, path, shown_name(storage, path))
        try:
            mode = os.stat(local).st_mode
        except FileNotFoundError:
            raise FileNotFoundError(f"{missing}{previous_copy_hint(local)}") from None
    except OSError as exc:  # a link loop, a name too long
        raise NotADirectoryError(f"{path} cannot be opened as a directory ({exc.strerror}): pass {what}") from None
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(f"{path} is a file, not a directory: pass {what}")


def committed_manifest(storage: Storage, path: Path, missing: str | None = None, operation: str = "load") -> Manifest:
    """The manifest of the committed checkpoint at `path`, for a caller that needs one (`operation`, whose fix a
    damaged manifest's refusal names): a missing directory is a FileNotFoundError (saying `missing`, see
    require_directory), a directory without a manifest an `IncompleteCheckpointError`, both naming `path`."""
    require_directory(storage, path, "a checkpoint directory (the one that holds manifest.json)", missing)
    manifest = read_manifest(storage, path, operation)
    if manifest is None and not still_there(storage, path):
        # Deleted (a prune) since it was found: gone, as a moment earlier, never a killed save's "not a checkpoint"
        require_directory(storage, path, "a checkpoint directory (the one that holds manifest.json)", missing)
    if manifest is None:
        raise IncompleteCheckpointError(
            f"{shown_name(storage, path)}: no {MANIFEST_FILE_NAME}: not a checkpoint"
            + (f".{hint}" if (hint := what_to_pass_instead(storage, path)) else "")  # as a load says it
        )
    return manifest


def _commit_time(storage: Storage, path: Path, manifest: Manifest) -> float | None:
    """The recorded commit time; for manifests written before it was recorded, the manifest's mtime.

    A recorded time that is not a finite unix time a calendar can show (JSON's `1e400` parses as infinity) is
    crafted: it is logged and counted as unknown, so it can neither win "newest" nor break a listing.
    """
    if manifest.commit_time is not None:
        if math.isfinite(manifest.commit_time) and 0.0 <= manifest.commit_time <= _MAX_COMMIT_TIME:
            return manifest.commit_time
        logger.warning(
            "%s records commit_time %r, which is not a unix time; it is treated as unknown",
            spelt(path),
            manifest.commit_time,
        )
        return None
    local = storage.local_path(path / MANIFEST_FILE_NAME)
    try:
        return os.path.getmtime(local) if local is not None else None
    except FileNotFoundError:  # deleted since it was read
        return None


def checkpoint_info(path: str | os.PathLike[str], storage: Storage | None = None) -> CheckpointInfo | None:
    """The `CheckpointInfo` of one directory, or None when it is not a committed checkpoint of ours."""
    storage = storage_of(path, storage, "path")
    return _checkpoint_info(Path(user_path(path, storage)), storage)


def _checkpoint_info(p: Path, storage: Storage, closed: list[PassedOver] | None = None) -> CheckpointInfo | None:
    """`checkpoint_info`; one whose manifest this user may not read is appended to `closed` (when given)."""
    if not storage.isdir(p):
        return None
    manifest = _manifest_or_none(storage, p, closed)
    if manifest is None:
        return None
    step = manifest.step if manifest.step is not None else step_from_name(p.name)
    return CheckpointInfo(
        path=spelt(p, local=isinstance(storage, LocalFileSystemStorage)),
        step=step,
        commit_time=_commit_time(storage, p, manifest),
        world_size=manifest.world_size,
        total_bytes=sum(r.size for r in manifest.files),
        metrics=manifest.metrics,
        library_version=manifest.library_version,
        items=tuple(sorted(manifest.keys())),
    )


def _sort_key(info: CheckpointInfo) -> tuple[int, float, str]:
    # A checkpoint without a step sorts before every stepped one: "newest" must not hinge on a guess.
    return (info.step if info.step is not None else -1, info.commit_time or 0.0, info.path)


def require_path(where: str | os.PathLike[str], what: str = "root") -> None:
    """Refuse an empty path: `Path("")` is the current directory, so `prune(os.environ.get("ROOT", ""), ...)` or
    `torch-checkpointing prune "$ROOT"` with ROOT unset listed, pruned and collected whatever was there. And a
    path of the wrong type (None, an int, bytes), which failed inside with a bare TypeError about a regex."""
    require_path_type(where, what)
    if os.fspath(where) in ("", b""):
        raise ConfigError(
            f"an empty {what} names no directory (an unset variable?); pass '.' for the current directory"
        )


def require_path_type(where: object, what: str) -> str | os.PathLike[str]:
    """`where`, refused unless a str path or an os.PathLike one (bytes paths are not taken) that a file system or
    a URL can hold: a lone surrogate (no bytes) made every directory test say "no such directory", and a root
    holding one listed nothing, which a resume took for a first run."""
    if isinstance(where, str) or (isinstance(where, os.PathLike) and isinstance(os.fspath(where), str)):
        refuse_unencodable(f"The {what}", where)
        return where
    fix = "decode it (.decode())" if isinstance(where, bytes) else "e.g. 'runs/my_job' or 's3://bucket/run'"
    raise ConfigTypeError(
        f"The {what} must be a str or os.PathLike path, got {type(where).__name__} ({where!r:.80}); {fix}."
    )


def storage_of(where: object, storage: object, what: str = "root") -> Storage:
    """The storage a public call on `where` uses: `storage` when the caller passed one, else the one `where`
    names (`storage_for`). Both arguments checked first: a StorageConfig passed for its storage, or an int path,
    failed deep inside with an AttributeError ('... has no attribute isdir') or a bare TypeError."""
    path = require_path_type(where, what)
    if storage is None:
        return storage_for(path)
    if isinstance(storage, Storage):
        _refuse_url_not_taken(path, storage, what)
        return storage
    fix = (
        f"pass {type(storage).__name__}(...).create_storage()"
        if isinstance(storage, StorageConfig)
        else "e.g. FsspecStorageConfig(url=...).create_storage()"
    )
    raise ConfigTypeError(
        f"storage= must be a Storage or None (None: the one the {what} names), got {type(storage).__name__} "
        f"({storage!r:.80}); {fix}."
    )


def _refuse_url_not_taken(where: str | os.PathLike[str], storage: Storage, what: str) -> None:
    """A URL on a storage that does not take URLs (`Storage.handles_url`, the manager's rule for ids) is refused.
    Read as a path, `file:///abs/run` on the local filesystem was a relative folder named `file:`: a listing found
    nothing there and `latest_checkpoint` returned None (a resume from scratch) beside committed checkpoints."""
    scheme = url_scheme(where)
    if scheme is None or storage.handles_url(os.fspath(where)):
        return
    if scheme in LOCAL_SCHEMES and isinstance(storage, LocalFileSystemStorage):
        raise local_url_refused(os.fspath(where), scheme, f"The {what} ")
    raise ConfigError(
        f"The {what} {os.fspath(where)!r} is a {scheme}:// URL, which the storage passed ({type(storage).__name__}) "
        f"does not take; pass storage=None to read the store the URL names, or a path on that storage."
    )


def list_checkpoints(root: str | os.PathLike[str], storage: Storage | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints directly under `root`, oldest first (by step, then commit time).

    Temporary, incomplete, trashed and foreign directories are skipped; a missing root lists nothing. An empty
    root is refused with a `ConfigError` (pass "." for the current directory).
    """
    return listing(root, storage).checkpoints


def user_path(where: str | os.PathLike[str], storage: Storage) -> str | os.PathLike[str]:
    """`where` with a leading `~` expanded where it names a local path, as the manager expands a save's id.

    `save("~/run/step_2", ...)` writes under the home directory; `latest_checkpoint("~/run")` looked for a
    directory named '~' instead, found none (a missing root lists nothing) and a job resuming from the root it
    saves under started from scratch, saying nothing. A URL, or a key on a storage passed in that is not the
    local filesystem, is taken as it is; so is a `Path`'s `~` (`config.home_expanded`)."""
    if url_scheme(where) is not None or not expands_home(storage):
        return where
    return home_expanded(where)


def expands_home(storage: Storage) -> bool:
    """Whether a leading `~` of a scheme-less path on `storage` is the home directory: on the local filesystem
    only; under any other store's root it is a key. The one rule for the manager's ids and the readers' roots:
    the manager expanded it for every storage config but `FsspecStorageConfig`, so a custom config building an
    object store had `save("~/a")` refused as the home directory's absolute path, while readers took `~/a`."""
    return isinstance(storage, LocalFileSystemStorage)


def listing(root: str | os.PathLike[str], storage: Storage | None = None) -> Listing:
    """`list_checkpoints`, and the entries under `root` skipped because this user may not read their manifest or
    directory, because a newer engine wrote their manifest, or because their manifest is damaged (each also
    warned about): `ls` names those too."""
    require_path(root)
    storage = storage_of(root, storage)
    base = Path(user_path(root, storage))
    if not storage.isdir(base):
        _refuse_a_file(base, storage)
        return Listing()
    names = _awaiting_replaces(base, sorted(storage.ls(base)), storage)
    _warn_left_aside(base, names, storage)
    candidates = []
    for name in names:
        if name.startswith("."):
            continue  # ours-in-progress or ours-being-deleted, never a committed checkpoint
        if _is_symlink(storage, base / name):
            logger.debug("Skipping %s: a symbolic link, never followed out of %s", base / name, base)
            continue
        candidates.append(name)
    found, closed = _infos_of(base, candidates, storage)
    if not found:
        warn_if_a_checkpoint(base, storage)
    seen = {Path(c.path).name for c in found} | {Path(c.path).name for c in closed}
    went = [n for n in candidates if n not in seen and not still_there(storage, base / n)]
    return Listing(sorted(found, key=_sort_key), closed, went)


# Entries of a remote root looked at once: each is a few requests' latency (a look, a manifest read), and one at
# a time a listing of 1105 checkpoints on S3 took 46 s (`latest_checkpoint` at every resume, retention at every save).
_REMOTE_LOOKS_AT_ONCE = 16
_LISTING_POOL = WorkerPool(1, "ckpt-list")  # grown to the looks at once (map_bounded)


def _infos_of(base: Path, names: list[str], storage: Storage) -> tuple[list[CheckpointInfo], list[PassedOver]]:
    """The checkpoints among `names` (entries of `base`) and those passed over, each in the order of `names`.
    On a store that is no local filesystem they are looked at several at once; the first failure to answer is
    raised (as one at a time, where it ended the listing), once every look started has stopped."""

    def look(name: str) -> tuple[CheckpointInfo | None, list[PassedOver]]:
        closed: list[PassedOver] = []
        return _checkpoint_info(base / name, storage, closed), closed

    remote = storage.local_path(base) is None and not storage.process_local(base)
    looked = _LISTING_POOL.map_bounded(look, names, _REMOTE_LOOKS_AT_ONCE if remote else 1)
    return [info for info, _ in looked if info is not None], [entry for _, closed in looked for entry in closed]


# What a root is, in the words of the errors that name one.
_ROOT = "the directory that holds the checkpoints (a run's root)"


def _refuse_a_file(base: Path, storage: Storage) -> None:
    """A root that is no directory lists nothing, unless it is a file, or a symbolic link to nothing (an unmounted
    volume, a run folder moved away): a resume that took "nothing listed" for a first run would start over, and a
    gc that found "nothing to collect" would never clean the run."""
    if storage.exists(base):
        raise NotADirectoryError(f"{spelt(base)} is a file, not a directory: pass {_ROOT}")
    if _is_symlink(storage, base):
        local = storage.local_path(base)
        raise FileNotFoundError(
            errno.ENOENT,
            f"{spelt(base)} is a symbolic link to {os.readlink(local) if local else '?'}, which does not exist (an "
            f"unmounted volume, a folder moved away): mount or restore it, or pass the directory the checkpoints "
            f"are in",
            os.fspath(base),
        )


def warn_if_a_checkpoint(base: Path, storage: Storage) -> None:
    """A checkpoint passed as the root lists nothing, and "nothing" reads as a first run to a resume."""
    if storage.exists(base / MANIFEST_FILE_NAME) and _manifest_or_none(storage, base) is not None:
        logger.warning(
            "%s is itself a checkpoint, not a root of checkpoints, so nothing is listed under it: pass its parent "
            "directory %s",
            spelt(base),
            spelt(base.parent),
        )


def _awaiting_replaces(base: Path, names: list[str], storage: Storage) -> list[str]:
    """`names` (the entries of `base`), with each id that held nothing while a live replace held a copy of it
    aside (between its two renames) once its new copy is in (`asides.await_replaced`). Before, a listing in that
    moment had no such id: latest_checkpoint() of a run re-saving one id (`latest`) returned None, a resume started
    over, and the WARNING said the save replacing it had been killed."""
    from torch_checkpointing.asides import await_replaced  # it lists checkpoints through this module

    present = set(names)
    for name in names:
        checkpoint = aside_of(name, present) if ASIDE_RE.match(name) is not None else None
        if checkpoint is None or checkpoint in present:
            continue
        with contextlib.suppress(FileNotFoundError):  # still empty: a replace killed or stalled there, warned of
            await_replaced(storage, base / checkpoint, spelt(base / checkpoint))
        if still_there(storage, base / checkpoint):
            present.add(checkpoint)
    return sorted(present)


def _warn_left_aside(base: Path, names: list[str], storage: Storage) -> None:
    """A committed checkpoint moved aside by a replace that was killed before the new one moved in is no
    listing's member (it is hidden) though its id is empty: say so, or "latest" silently goes back a step."""
    present = set(names)
    for name in names:
        if ASIDE_RE.match(name) is None:
            continue
        checkpoint = aside_of(name, present)  # None: a cut name whose id holds nothing
        if checkpoint in present or not _exists_or_closed(storage, base / name / MANIFEST_FILE_NAME):
            continue
        logger.warning(
            "Checkpoint %s is missing, and its previous copy is at %s (a save that replaced it was killed before "
            "the new one moved in); it is not listed. Run `torch-checkpointing gc %s` to move it back.",
            spelt(base / checkpoint) if checkpoint is not None else f"{spelt(base)}/<id cut from {name}>",
            spelt(base / name),
            spelt(base),
        )


def _exists_or_closed(storage: Storage, path: Path) -> bool:
    """`storage.exists(path)`, False where a directory on the way is closed to this user: a look that only
    sorts the entries of a root (is this one a leftover?) names such a directory (`unreadable`) and goes on."""
    try:
        return storage.exists(path)
    except PermissionError:
        return False


def unreadable(storage: Storage, path: Path) -> str | None:
    """Why the local directory `path` cannot be looked into (the OS's words), or None: gc keeps such a one and
    says so, where it said that it held nothing of ours."""
    local = storage.local_path(path)
    if local is None:
        return None
    try:
        os.listdir(local)
    except PermissionError as exc:
        return (
            f"it cannot be read ({exc.strerror}): give this user read and search permission on it, or run as its owner"
        )
    except OSError:
        return None
    return None


def _is_symlink(storage: Storage, path: Path) -> bool:
    """Whether `path` is a symbolic link: the engine never makes one, so what it points at is never ours."""
    local = storage.local_path(path)
    return local is not None and os.path.islink(local)


def latest_checkpoint(root: str | os.PathLike[str], storage: Storage | None = None) -> CheckpointInfo | None:
    """The newest intact committed checkpoint under `root` (highest step, then latest commit), or None.

    "Intact" is what a resume needs and costs no data file read: every file the manifest records is there,
    inside the directory, a regular file of the recorded size, in a format this engine reads, and the sharding
    metadata (of a resharded checkpoint) parses at a version this engine reads. A newer checkpoint that fails
    it (half deleted by hand, a file lost or swapped for a link) is skipped with a WARNING naming the file.
    """
    storage = storage_of(root, storage)
    return current_resume_point(user_path(root, storage), storage)[1]


def _warn_if_named_steps_disagree(latest: CheckpointInfo, checkpoints: list[CheckpointInfo]) -> None:
    """A step taken from an id's trailing integer (what save() records without `step=`) may be no step:
    `ckpt-2026-11-30` reads as step 30, newer than `ckpt-2026-12-01` (step 1), and `step500_epoch3` as step 3.
    When a checkpoint committed after the latest one has a lower step, both steps being their ids' trailing
    integers, say so: the resume may be going back in time."""
    step = _ids_number_step(latest)
    if latest.commit_time is None or step is None:
        return
    for other in checkpoints:
        later = other.commit_time is not None and other.commit_time > latest.commit_time
        other_step = _ids_number_step(other)
        if later and other_step is not None and other_step < step:
            logger.warning(
                "The latest checkpoint %s is newest by its step %d, the trailing integer of its id, but %s was "
                "committed after it with step %d, also its id's trailing integer. If ids carry dates or several "
                "numbers, pass save(..., step=N) so that the order is the training step's, not the id's.",
                latest.path,
                step,
                other.path,
                other_step,
            )
            return


def _ids_number_step(info: CheckpointInfo) -> int | None:
    """The step, when it is the trailing integer of the id (what save() records without `step=`)."""
    return info.step if info.step is not None and info.step == step_from_name(Path(info.path).name) else None


# How many times one id is checked again when a save replaced it while it was being checked.
_REPLACED_RETRIES = 5


def newest_intact(checkpoints: list[CheckpointInfo], storage: Storage) -> CheckpointInfo | None:
    """The last of `checkpoints` (sorted oldest first) that `damage` finds nothing wrong with."""
    return resume_point(checkpoints, storage)[0]


def resume_point(checkpoints: list[CheckpointInfo], storage: Storage) -> tuple[CheckpointInfo | None, list[PassedOver]]:
    """(the newest intact one of `checkpoints`, sorted oldest first, or None; the newer ones it passed over,
    newest first, each with what is wrong with it and whether that is damage or only this user's permissions): a
    listing that shows those as the newest rows must say so, and must not call an unreadable one damaged.
    """
    info, passed_over, _ = _resume_point(checkpoints, storage)
    return info, passed_over


def _resume_point(
    checkpoints: list[CheckpointInfo], storage: Storage
) -> tuple[CheckpointInfo | None, list[PassedOver], bool]:
    """`resume_point`, and whether one of `checkpoints` it looked at was deleted since it was listed."""
    passed_over: list[PassedOver] = []
    deleted = False
    for listed in reversed(checkpoints):
        info, problem = _intact_now(listed, storage)
        if problem is None:
            if info is not None:
                _warn_if_named_steps_disagree(info, checkpoints)
            return info, passed_over, deleted
        if info is not None:
            logger.warning("Skipping checkpoint %s as a resume point: %s", info.path, problem.text)
            passed_over.append(PassedOver(info.path, problem.text, problem.unreadable))
        else:
            deleted = True
    return None, passed_over, deleted


def current_resume_point(
    root: str | os.PathLike[str], storage: Storage
) -> tuple[Listing, CheckpointInfo | None, list[PassedOver]]:
    """(the listing of `root`, its `resume_point`), listed again when an entry it named was deleted before it was
    looked at: a retention pass deletes only after a newer save committed, which a listing taken before that
    commit does not hold. Before, `latest_checkpoint` of a run whose job saved and pruned at that moment returned
    None (or an older checkpoint), though the root held a newer one at every instant: a resume started over."""
    listed = listing(root, storage)
    latest, passed_over, deleted = _resume_point(listed.checkpoints, storage)
    for _ in range(_REPLACED_RETRIES - 1):
        if not (deleted or listed.went):
            break
        logger.debug("%s: entries deleted while listed (%s); listing it again", spelt(Path(root)), listed.went)
        listed = listing(root, storage)
        latest, passed_over, deleted = _resume_point(listed.checkpoints, storage)
    return listed, latest, passed_over


@dataclass(frozen=True)
class Problem:
    """What keeps a checkpoint from loading; `unreadable` when it is this user's permissions, not its bytes."""

    text: str
    unreadable: bool = False


def _intact_now(info: CheckpointInfo, storage: Storage) -> tuple[CheckpointInfo | None, Problem | None]:
    """(the checkpoint now at `info.path`, what is wrong with it or None).

    A save that replaces the id while it is checked swaps the directory and removes the old copy, whose files
    then look missing: that is no damage. When the id holds another commit than the one checked, the new one
    is checked instead; (None, problem) when the id was deleted meanwhile (nothing to warn about).
    """
    problem: Problem | None = None
    for _ in range(_REPLACED_RETRIES):
        problem = problem_with(info.path, storage)
        if problem is None:
            return info, None
        now = checkpoint_info(info.path, storage)
        if now is None and not still_there(storage, Path(info.path)):
            logger.debug("%s was deleted while it was checked: %s", info.path, problem)
            return None, problem
        if now is None or now.commit_time == info.commit_time:
            return info, problem  # the same commit (or no longer a checkpoint): damaged, as found
        logger.debug("%s was replaced by a new save while it was checked; checking the new one", info.path)
        info = now
    return info, problem


def damage(path: str | os.PathLike[str], storage: Storage | None = None) -> str | None:
    """None when every file the manifest of `path` records is present, contained, regular, of its recorded size
    (opened the way a load opens it: no symlink, no FIFO, no path out of the directory) and recorded in a format a
    load reads; else what is wrong.

    Checksums are not read (`torch-checkpointing verify` reads every byte). A store that failed to answer is no
    damage: its `ObjectStoreError` is raised (before, the newest checkpoint was passed over and a resume went back
    a step).
    """
    found = problem_with(path, storage)
    return None if found is None else found.text


def problem_with(path: str | os.PathLike[str], storage: Storage | None = None) -> Problem | None:
    """`damage`, told apart from a file or directory this user may not read (a `PermissionError`, by its type:
    its bytes were never seen, so it is no damage, and a listing must not call it so). This process short of
    file descriptors or memory is raised, as a store's silence is: every checkpoint read as damaged, and
    `latest_checkpoint` returned an older one, or None (a resume from scratch), of intact checkpoints."""
    storage = storage_of(path, storage, "path")
    path = user_path(path, storage)
    try:
        with CheckpointReadContext(
            storage,
            os.fspath(path),
            ReadPolicy(verify_checksums=False, allow_legacy_checkpoints=False),
            reads=False,
            operation="check",
        ) as ctx:
            if ctx.manifest is None:
                return Problem(f"no {MANIFEST_FILE_NAME}")
            for record in ctx.manifest.files:
                ctx.check(record.path, f"item '{record.key}' of rank {record.rank}")
                # A format no load reads (a crafted or newer record): the checkpoint cannot be resumed from.
                record.serialization_format(ctx.root / MANIFEST_FILE_NAME)
            if ctx.manifest.metadata_file is not None:
                ctx.check(ctx.manifest.metadata_file, "sharding metadata")
                _check_metadata_version(ctx)
    except ObjectStoreError:
        raise
    except (PermissionError, NewerCheckpointError) as exc:  # no damage: a listing must not call it so
        return Problem(str(exc), unreadable=True)
    except (CheckpointError, OSError) as exc:
        if not isinstance(exc, CheckpointError):
            raise_if_short_of_resources(exc, path, "the check that it can be loaded")
        return Problem(str(exc))
    return None


def _check_metadata_version(ctx: CheckpointReadContext) -> None:
    """Raise when no load here reads the sharding metadata: a newer engine's version (`NewerCheckpointError`, no
    damage) or a file that is no metadata. The file is parsed, none of its items is. Before, such a checkpoint was
    the resume point, and the resume's load refused it."""
    from torch_checkpointing.distributed_metadata import read_distributed_metadata, unknown_types_as_stored

    try:
        with unknown_types_as_stored():
            read_distributed_metadata(ctx, keys=())
    except NewerCheckpointError:
        _metadata_as_recorded(ctx)
        raise


def _metadata_as_recorded(ctx: CheckpointReadContext) -> None:
    """Raise when the sharding metadata's bytes are not what the manifest records (its CRC32). A listing reads
    no checksums, but before it calls a checkpoint a newer engine's ("do not delete it") it checks the bytes that
    say so: a changed byte in '"version": "3.0"' reads as a newer version."""
    assert ctx.manifest is not None and ctx.manifest.metadata_file is not None  # the caller read the metadata
    name, recorded = ctx.manifest.metadata_file, ctx.manifest.metadata_crc32
    actual = zlib.crc32(ctx.read_bytes(name, "sharding metadata"))
    if recorded is not None and actual != recorded:
        raise CorruptCheckpointError(
            f"File {ctx.root / name} (sharding metadata) fails its CRC32 check (manifest {recorded:#010x}, file "
            f"{actual:#010x}): the checkpoint is damaged, not a newer engine's. {on_another(ctx.operation)}"
        )


# ------------------------------------------------------------------------------------------------ leftovers


# What `_tree_bytes` could not count, already warned of in this process: the gc after every commit lists the
# leftovers with their sizes, and the same closed directory was a new WARNING at every save.
_SHORT_SIZES_TOLD: set[tuple[str, str]] = set()


def _tree_bytes(path: str) -> int:
    """The bytes of the files under the leftover `path`, as `ls` and gc's report give it. What cannot be looked
    at (a directory this user may not list) is named at WARNING the first time in this process (at DEBUG after),
    the size then being short of it: before, it was passed over in silence, and a leftover holding gigabytes in a
    closed rank directory was shown as a few bytes.
    """
    total = 0

    def not_counted(exc: OSError) -> None:
        if isinstance(exc, FileNotFoundError):  # removed meanwhile: nothing is left to count
            return
        said = (path, str(exc))
        level = logging.DEBUG if said in _SHORT_SIZES_TOLD else logging.WARNING
        _SHORT_SIZES_TOLD.add(said)
        logger.log(level, "The size given for %s is short: %s not counted (%s)", path, exc.filename, exc)

    for dirpath, _, files in os.walk(path, onerror=not_counted):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError as exc:
                not_counted(exc)
    return total


# How much later than a hidden name was made its pid's process must have started to be judged another process.
OWNER_STARTED_AFTER_S = 5.0


def hidden_name_alive(match: re.Match[str], path: Path, storage: Storage | None = None) -> bool | None:
    """Whether the process that made a hidden name (`.old_`, `.trash-`: its `ASIDE_RE`/`TRASH_RE` match) may still
    be using it; None when that cannot be told here: another host made it, and its pid names no process of this
    host (on a shared filesystem, gc took a live replacer there for a dead one, and put its copy back under it).
    This process's own pid says so only for names it holds now: a job restarted in a container often gets the pid
    of the one that was killed, and that one's leftovers are garbage, not this process's work in flight. Another
    live process with the pid is not its maker when it started after the name was made (a pid the kernel gave
    again: in a container, pids are few and soon reused, and gc kept a dead replace's copy aside while the id held
    nothing). `storage`: the store `path` is on, where it is no local filesystem (its clock and stamps tell).
    """
    if not made_here(match):
        return None
    pid = int(match["pid"])
    if pid == os.getpid():
        return held_here(path)
    return pid_alive(pid) and not _started_after(pid, path, storage)


def _started_after(pid: int, path: Path, storage: Storage | None = None) -> bool:
    """Whether process `pid` of this host started clearly after `path` got its name (a rename sets its ctime),
    both measured as ages now; False when either cannot be told (another host's name, no /proc). The name's age
    is read on the clock that stamped it (the file server's: `local_store_now`): by this host's, a host ahead of
    its server by more than `OWNER_STARTED_AFTER_S` took a live replace's copy aside for a dead one's whose pid a
    later process has, and gc put the old copy back under the id while the replace was between its renames."""
    try:
        made_s_ago = _named_s_ago(path, storage)
        with open(f"/proc/{pid}/stat", "rb") as f:
            started_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            up_s = float(f.read().split()[0])
    except ObjectStoreError:  # the store failed the name's age: no proof either way (`_our_marker`)
        raise
    except (OSError, ValueError, IndexError, CheckpointError):
        return False
    running_s = up_s - started_ticks / os.sysconf("SC_CLK_TCK")
    return made_s_ago is not None and running_s < made_s_ago - OWNER_STARTED_AFTER_S


def _named_s_ago(path: Path, storage: Storage | None) -> float | None:
    """How long ago `path` got its name, on the clock that stamped it: a local path's ctime (a rename sets it)
    against the file server's clock; on a store that is no local filesystem, `Storage.changed_at` against
    `Storage.store_now` (before, an object store's name was never told apart from a reused pid's: its copy
    aside or trash counted as that later process's, kept for as long as it ran). None where it cannot be told."""
    if storage is not None and storage.local_path(path) is None:
        changed = storage.changed_at(path)
        return None if changed is None else storage.store_now(path.parent) - changed
    local = os.fspath(path) if storage is None else storage.local_path(path)
    named = os.lstat(local or path).st_ctime  # first: an object store's path probes no local folder of that name
    return local_store_now(os.path.dirname(os.path.abspath(local or path))) - named


# Jobs of this process: how many open managers hold each uid's owner lock, and the uids whose every manager here
# has closed. A claim this process made for such a job is dead, although its pid is alive (`job_ended_here`).
_jobs_lock = threading.Lock()
_jobs_open: dict[str, int] = {}
_jobs_ended: set[str] = set()


def job_ended_here(uid: str) -> bool:
    """Whether job `uid` had a manager in this process and none is open any more: its saves here have ended.

    The pid a claim records cannot tell (it is this very process, alive), nor can the owner lock, whose file
    the last manager removed when it closed."""
    with _jobs_lock:
        return uid in _jobs_ended and not _jobs_open.get(uid)


def _job_opened(uid: str) -> None:
    with _jobs_lock:
        _jobs_open[uid] = _jobs_open.get(uid, 0) + 1


def _job_closed(uid: str) -> None:
    with _jobs_lock:
        left = _jobs_open.get(uid, 1) - 1
        if left > 0:
            _jobs_open[uid] = left
            return
        _jobs_open.pop(uid, None)
        _jobs_ended.add(uid)


def owner_lock_path(uid: str) -> str:
    """The host-local lock file every live manager of job `uid` holds (shared) for its whole life."""
    base = os.environ.get("TORCH_CHECKPOINTING_LOCK_DIR") or os.path.join(
        tempfile.gettempdir(), "torch_checkpointing-owners"
    )
    return os.path.join(base, f"{uid}.lock")


def owner_alive(uid: str) -> bool | None:
    """Whether a live manager of job `uid` holds its owner lock on this host; None when there is no lock file.

    The lock directory is shared by every user of the host, so the file is opened without blocking or following
    a link: a FIFO (or a link) planted under a job's uid would otherwise hang gc, or lock somebody else's file.
    Such a file proves nothing about the owner: None (judged by age), with a WARNING.
    """
    path = owner_lock_path(uid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # short of descriptors, a live save's temporary was judged by age, and gc removed it
        raise_if_short_of_resources(exc, path, "the check whether its job is alive")
        logger.warning("Owner lock %s cannot be opened (%s); its job's temporaries are judged by age", path, exc)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        logger.warning("Owner lock %s is not a regular file; its job's temporaries are judged by age", path)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True  # live managers hold it shared
        raise
    finally:
        os.close(fd)
    return False


def _marked(storage: Storage, path: Path) -> bool:
    """Whether a directory holds what only the engine leaves in its directories, or nothing at all.

    Every directory the engine names `.tmp-`/`.old_`/`.trash-` has its manifest or `.incomplete` marker at the
    top until its very last file is removed (retention removes those two last), so one holding neither, and not
    empty, is not ours, whatever its name. This process short of descriptors or memory is raised, here and in
    the checks below: gc called a leftover of ours "holds no manifest.json or .incomplete of ours" when it could
    not open one.
    """
    local = storage.local_path(path)
    if local is not None:
        try:
            entries = os.listdir(local)
        except OSError as exc:
            raise_if_short_of_resources(exc, path, "the check that the directory is ours")
            return False
        names = set(entries)
        if MANIFEST_FILE_NAME in names and _is_regular(os.path.join(local, MANIFEST_FILE_NAME)):
            return not _foreign_manifest(storage, path / MANIFEST_FILE_NAME)
        marker = os.path.join(local, INCOMPLETE_MARKER)
        return not entries or (INCOMPLETE_MARKER in names and _is_regular(marker) and _our_marker(storage, path))
    if storage.exists(path / MANIFEST_FILE_NAME):
        return not _foreign_manifest(storage, path / MANIFEST_FILE_NAME)
    return storage.exists(path / INCOMPLETE_MARKER) and _our_marker(storage, path)


def _our_marker(storage: Storage, path: Path) -> bool:
    """Whether the `.incomplete` in the directory `path` is one we write: empty (where saves rename, and a
    delete's), or a save's claim. A download tool's `.incomplete` (its progress) made a folder named like ours
    "ours", and gc deleted it (on an object store, whatever its name). One that cannot be read (removed
    meanwhile) is not proof."""
    try:
        data = read_marker(storage, path / INCOMPLETE_MARKER)
    except OSError as exc:
        raise_if_short_of_resources(exc, path / INCOMPLETE_MARKER, "the check that the marker is ours")
        return False
    except ObjectStoreError:  # the store failed the read: no proof either way (`_foreign_manifest`)
        raise
    except CheckpointError:  # larger than any marker of ours, too
        return False
    return our_marker(data)


def _foreign_manifest(storage: Storage, path: Path) -> bool:
    """Whether the `manifest.json` at `path` is another tool's (valid JSON, not ours): a name is no proof, and
    gc deleted a folder named like ours because it held a browser extension's manifest (on an object store, a
    prefix named like a trash or temporary of ours likewise). One we cannot parse (a write killed midway,
    removed meanwhile) still counts as ours, so that gc collects what a kill left."""
    try:
        parse_manifest(read_bounded(storage, path), str(path))
    except ForeignManifestError:
        return True
    except ObjectStoreError:  # the store failed the read: that proves nothing ours either (`_beside_marker`)
        raise
    except CheckpointError:
        return False
    except OSError as exc:  # short of descriptors, the folder counted as ours, and gc removed another tool's
        raise_if_short_of_resources(exc, path, "the check that the manifest is ours")
        return False
    return False


def _is_regular(local: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(local).st_mode)
    except FileNotFoundError:  # removed since it was listed (a gc or a removal in another process)
        return False


def _classify(root: Path, name: str, storage: Storage) -> Leftover | None:
    path = root / name
    if _is_symlink(storage, path):
        return None  # a link to somebody's directory is never ours, whatever its name
    if m := CLOCK_PROBE_RE.match(name):
        return _probe_leftover(path, m, storage)
    if not storage.isdir(path):
        return None
    shown = spelt(path)  # a URL as a user passes it on (`Path` folded `s3://b/run` into `s3:/b/run`)
    local = storage.local_path(path)
    size = _tree_bytes(local) if local is not None else storage.tree_bytes(path)
    if m := TMP_RE.match(name):
        alive = owner_alive(m["uid"])
        # A lock file of this uid on this host proves the name is one of ours, even once its marker is gone.
        recognised = alive is not None or _marked(storage, path)
        detail = f"save {m['uid']}-{m['seq']}"
        return Leftover(shown, "temporary", m["name"], alive, size, detail, recognised)
    if m := ASIDE_RE.match(name):
        alive = hidden_name_alive(m, path, storage)
        return Leftover(shown, "replaced", m["name"], alive, size, f"pid {m['pid']}", _marked(storage, path))
    if m := TRASH_RE.match(name):
        alive = hidden_name_alive(m, path, storage)
        return Leftover(shown, "trash", m["name"], alive, size, f"pid {m['pid']}", _marked(storage, path))
    if not name.startswith(".") and _exists_or_closed(storage, path / INCOMPLETE_MARKER):
        beside = _beside_marker(storage, path)
        if beside == "newer":  # what a marker beside a newer engine's commit means is that engine's to tell
            return Leftover(shown, "incomplete", name, None, size, "a newer engine's checkpoint", newer_engine=True)
        if beside == "ours":
            # Only the marker is left over (gc removes it alone), not the checkpoint it sits in.
            return Leftover(shown, "claim", name, None, 0, "a stopped save's claim beside a committed checkpoint")
        # Another tool's `.incomplete` (a download's progress) does not make a user's folder ours.
        recognised = _our_marker(storage, path)
        return Leftover(shown, "incomplete", name, None, size, "has the .incomplete marker", recognised)
    return None


def _probe_leftover(path: Path, match: re.Match[str], storage: Storage) -> Leftover | None:
    """A probe of the store's clock (`base_storage.store_now`) still there: the empty file or object a process
    killed between its create and its removal left (before, kept for good: gc passed over it). Its process is
    alive while its pid runs on this host in a process that ran when it was made (this process's own only while
    it writes it: the pid of a killed job restarted in a container; another's started since is the pid given
    again, as `hidden_name_alive` judges: counted alive, a probe stayed while any process had the pid); another
    host's goes by its age. Anything else so named (a directory, a file with bytes in it) is nobody's probe, and
    not listed."""
    try:
        if storage.isdir(path) or storage.getsize(path) != 0:
            return None
    except FileNotFoundError:
        return None  # removed meanwhile: its prober was done
    pid = int(match["pid"])
    alive = None
    if made_here(match):
        alive = clock_probe_running(path.name) if pid == os.getpid() else hidden_name_alive(match, path)
    return Leftover(spelt(path), "probe", path.name, alive, 0, f"clock probe of pid {pid}")


def _beside_marker(storage: Storage, path: Path) -> str | None:
    """What the manifest at `path`, beside a marker, is: "ours" (committed: the marker is another save's claim,
    `manifest.stray_claim`), "newer" (a newer engine's, `NewerCheckpointError`), or None (none this engine reads).

    A newer engine's manifest read as none made the directory an unfinished save: on an object store, once the
    marker's claim was dead (a save of ours killed right after claiming the id the newer engine had just
    committed), gc removed the newer engine's checkpoint, where before the version was read it removed only the
    stray claim. A manifest recording a format only a newer engine knows is that engine's too (a load is refused
    lazily, per file; here the whole manifest is judged): read as ours, gc removed its marker as a stray claim.

    A read the store failed (`ObjectStoreError`: the manifest's, or the marker's) is raised, as a shortage is:
    taken for "none", a committed checkpoint beside a dead stray claim read as an unfinished save, and gc
    removed it whole."""
    try:
        manifest = read_manifest(storage, path)
        if manifest is not None:
            check_formats_known(manifest, str(path / MANIFEST_FILE_NAME))
        return "ours" if manifest is not None else None
    except NewerCheckpointError:
        return "newer"
    except ObjectStoreError:  # the store failed the read (a 503 through every retry): that tells nothing either
        raise
    except OSError as exc:  # this process short of descriptors is no unfinished save: gc removed it whole
        raise_if_short_of_resources(exc, path / MANIFEST_FILE_NAME, "the check whether the marker beside it is stray")
        return None
    except CheckpointError:
        return None


def list_leftovers(root: str | os.PathLike[str], storage: Storage | None = None) -> list[Leftover]:
    """Directories under `root` that saves, replacements or deletions of ours left behind (nothing foreign)."""
    require_path(root)
    storage = storage_of(root, storage)
    base = Path(user_path(root, storage))
    if not storage.isdir(base):
        _refuse_a_file(base, storage)
        return []
    out = [_classify(base, name, storage) for name in sorted(storage.ls(base))]
    # One removed while it was looked into (a gc in another process) held nothing by then: no user's folder.
    return [o for o in out if o is not None and still_there(storage, Path(o.path))]


# ------------------------------------------------------------------------------------------------ ownership


class OwnerLock:
    """A shared flock held by a live manager, so that `gc` can tell its temporary directories from dead ones.

    A save's temporary directory carries the manager's uid (shared by every rank of a job). Every rank's
    manager holds `owner_lock_path(uid)` shared for its whole life; the kernel drops the lock when the process
    dies, however it dies, so a lock that can be taken exclusively proves every owner on this host is gone.
    The file lives in a host-local directory, never beside the checkpoints, so saves leave nothing extra there.
    """

    def __init__(self, uid: str) -> None:
        self.uid = uid
        self._open = True  # counted in `job_ended_here` until released, whether or not the file could be locked
        _job_opened(uid)
        self._fd: int | None = None
        self._close_when_collected: weakref.finalize[[int], OwnerLock] | None = None
        path = owner_lock_path(uid)
        try:
            _make_lock_dir(os.path.dirname(path))
            self._fd = _open_locked(path)
            # A holder dropped without release() gives its descriptor back when collected (the kernel drops the
            # lock with it); the file stays, as when its process dies.
            self._close_when_collected = weakref.finalize(self, os.close, self._fd)
        except OSError as exc:
            logger.warning(
                "Owner lock %s could not be taken (%s): `gc` cannot tell this job's in-progress saves from abandoned "
                "ones and judges them by age only (`gc --older-than` could remove a live save's temporary "
                "directory). Set TORCH_CHECKPOINTING_LOCK_DIR to a writable directory on this host.",
                path,
                exc,
            )

    @property
    def held(self) -> bool:
        """Whether this holder has the lock file locked (False where it could not be taken, or once released)."""
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock; the last holder also removes the file (upgrading to exclusive proves it is the last)."""
        if self._open:
            self._open = False
            _job_closed(self.uid)
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if self._close_when_collected is not None:
            self._close_when_collected.detach()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(owner_lock_path(self.uid))
        except OSError as exc:  # another rank still holds it (or it is gone already)
            logger.debug("Owner lock %s kept: %r", owner_lock_path(self.uid), exc)
        finally:
            os.close(fd)


def _make_lock_dir(directory: str) -> None:
    """Shared by every user of the host, like /tmp itself (sticky: each user removes only their own files)."""
    if os.path.isdir(directory):
        return
    os.makedirs(directory, exist_ok=True)
    with contextlib.suppress(OSError):  # another user created it first
        os.chmod(directory, 0o1777)


def _open_locked(path: str) -> int:
    """Open-and-lock that survives the last holder unlinking the file between our open and our flock."""
    for _ in range(10):
        # Not through a link or into a FIFO another user of the shared directory planted under our name.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{path} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise OSError(f"could not hold {path}: it keeps being removed")


# ------------------------------------------------------------------------------------------------ self-describing


def self_describing_layouts(
    storage: Storage, checkpoint_id: str | os.PathLike[str], rank: int, world_size: int, keys: list[str] | None = None
) -> dict[str, LayoutInfo]:
    """Per item key, the file and format this rank should read, as the checkpoint's manifest records them.

    A rank reads its own record; an item written once for all ranks (a fixed path, by the lowest rank) is read
    from that one record. JSON items come back as plain JSON: a recorded class name is never imported (the
    manifest is untrusted input). `keys` restricts the result and names the checkpoint's keys on a typo.
    """
    # A load's own wording for a missing id (API_SURFACE §2.4), whether or not into= was given.
    missing = f"Checkpoint path {shown_name(storage, checkpoint_id)} does not exist."
    manifest = committed_manifest(storage, Path(checkpoint_id), missing)
    available = sorted(manifest.keys())
    wanted = available if keys is None else keys
    unknown = [k for k in wanted if k not in available]
    if unknown:
        raise MissingItemError(f"Checkpoint {checkpoint_id} has no item(s) {unknown}; it holds {available}.")
    out: dict[str, LayoutInfo] = {}
    for key in wanted:
        per_rank = [r for r in manifest.files if r.key == key]
        if len(per_rank) > 1 and manifest.world_size != world_size:
            # A load with templates refuses this as TemplateMismatchError (also a ValueError): so does this one.
            raise TemplateMismatchError(
                f"Item '{key}' of {checkpoint_id} was saved as per-rank files by {manifest.world_size} rank(s) and "
                f"this job has {world_size}: reading rank {rank}'s file would hand back another shard. Load it "
                f"with into= templates and ItemSpec(resharder=...), or on {manifest.world_size} rank(s)."
            )
        record = manifest.record(key, rank)
        if record is None:
            owners = sorted((r for r in manifest.files if r.key == key), key=lambda r: r.rank)
            if len(owners) != 1:
                raise MissingItemError(
                    f"Item '{key}' of {checkpoint_id} was written by ranks {[r.rank for r in owners]} but not by rank "
                    f"{rank}; load it with into= and a resharder, or on {manifest.world_size} rank(s)."
                )
            record = owners[0]
        out[key] = LayoutInfo(record.path, record.serialization_format(Path(checkpoint_id) / MANIFEST_FILE_NAME))
    return out
