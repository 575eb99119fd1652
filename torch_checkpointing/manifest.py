"""The manifest: the JSON file whose presence makes a checkpoint directory a complete checkpoint.

It is written last, by rank 0, after every rank's files are durable; the directory is then renamed into
place. A directory with the `.incomplete` marker and no manifest is a save that never finished.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import posixpath
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from torch_checkpointing.checkpoint_layout import SerializationFormat, untrusted_format_from_dict
from torch_checkpointing.checksum import BlockChecksums
from torch_checkpointing.errors import (
    CheckpointError,
    CheckpointReplacedError,
    CorruptCheckpointError,
    ForeignManifestError,
    IncompleteCheckpointError,
    NewerCheckpointError,
    UnsafeCheckpointError,
    on_another,
    raise_if_short_of_resources,
    unreadable_file,
)
from torch_checkpointing.names import TMP_RE, TRASH_RE, step_from_name
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.version import __version__

__all__ = [
    "GC_TOKEN_PREFIX",
    "INCOMPLETE_MARKER",
    "MANIFEST_FILE_NAME",
    "MANIFEST_VERSION",
    "MAX_MARKER_BYTES",
    "MAX_WORLD_SIZE",
    "UNNAMED_SAVE",
    "DuplicateKeyError",
    "FileRecord",
    "Manifest",
    "check_json_tree",
    "claim_token",
    "gc_collects",
    "incomplete",
    "our_marker",
    "parse_manifest",
    "read_bounded",
    "read_local_regular",
    "read_manifest",
    "read_marker",
    "read_stored_bounded",
    "shown_name",
    "stray_claim",
    "unique_keys",
]

# More ranks than any job has: a manifest or sharding metadata that records more is crafted.
MAX_WORLD_SIZE = 1 << 20
MANIFEST_FILE_NAME = "manifest.json"
INCOMPLETE_MARKER = ".incomplete"
_KIND = "torch_checkpointing.manifest"
MANIFEST_VERSION = 1  # the only manifest version this engine writes and reads


@dataclass(frozen=True)
class FileRecord:
    key: str
    rank: int
    path: str
    size: int
    crc32: int
    format: dict[str, Any]
    # The CRC32 of each fixed-size block, so a ranged read verifies only the blocks it touches; absent from
    # manifests written before block checksums (those files are verified whole).
    blocks: BlockChecksums | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "key": self.key,
            "rank": self.rank,
            "path": self.path,
            "size": self.size,
            "crc32": self.crc32,
            "format": self.format,
        }
        if self.blocks is not None:
            d["blocks"] = self.blocks.to_json()
        return d

    def serialization_format(self, manifest: Path | str) -> SerializationFormat:
        """The format this record says its file was written in, as every reader turns it into one (nothing named
        in it imported); a record no format reads is a `CorruptCheckpointError` naming `manifest` and the field."""
        where = f"{manifest}: field 'items.{self.key}.{self.rank}.format' (file {self.path!r})"
        return untrusted_format_from_dict(self.format, where)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileRecord:
        size = int(d["size"])
        blocks = d.get("blocks")
        return cls(
            d["key"],
            int(d["rank"]),
            d["path"],
            size,
            int(d["crc32"]),
            d["format"],
            None if blocks is None else BlockChecksums.from_json(blocks, size, f"file record {d['path']!r}"),
        )


@dataclass(frozen=True)
class Manifest:
    world_size: int
    library_version: str
    files: tuple[FileRecord, ...]
    metadata_file: str | None = None
    # Optional facts about the save, for discovery/retention tools; absent from older manifests.
    step: int | None = None
    metrics: dict[str, float] | None = None
    commit_time: float | None = None  # unix seconds, taken just before the manifest is written
    # Size and CRC32 of the metadata file, so a load verifies it like any item file; absent from older manifests.
    metadata_size: int | None = None
    metadata_crc32: int | None = None
    # On a store where the `.incomplete` marker is the save's claim on the id (object stores): that save's
    # claim token, so that another save's claim found beside this manifest is told apart (`stray_claim`).
    claim: str | None = None

    def to_json(self) -> str:
        items: dict[str, dict[str, Any]] = {}
        for rec in sorted(self.files, key=lambda r: (r.key, r.rank)):
            items.setdefault(rec.key, {})[str(rec.rank)] = rec.to_dict()
        return json.dumps(
            {
                "kind": _KIND,
                "manifest_version": MANIFEST_VERSION,
                "library_version": self.library_version,
                "world_size": self.world_size,
                "metadata_file": self.metadata_file,
                "items": items,
                **_extras(self),
            },
            sort_keys=True,
            indent=2,
            allow_nan=False,  # parsed strictly: a non-finite value fails the save here, not every later read
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate a manifest; anything malformed raises `CorruptCheckpointError` naming the field."""
        return parse_manifest(text, MANIFEST_FILE_NAME)

    def record(self, key: str, rank: int) -> FileRecord | None:
        for rec in self.files:
            if rec.key == key and rec.rank == rank:
                return rec
        return None

    def keys(self) -> set[str]:
        return {rec.key for rec in self.files}


def _extras(manifest: Manifest) -> dict[str, Any]:
    """The optional fields that are set (so a manifest without them reads exactly as before)."""
    extras = {
        "step": manifest.step,
        "metrics": None if manifest.metrics is None else {k: _metric_json(v) for k, v in manifest.metrics.items()},
        "commit_time": manifest.commit_time,
        "metadata_size": manifest.metadata_size,
        "metadata_crc32": manifest.metadata_crc32,
        "claim": manifest.claim,
    }
    return {k: v for k, v in extras.items() if v is not None}


# A metric JSON has no number for: a diverged loss is NaN, and its checkpoint is still one to keep and load
# (strict JSON parsing refused the NaN constant json.dumps wrote, so that checkpoint never loaded).
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _metric_json(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _metric_value(value: Any) -> float | None:
    """A recorded metric as a float; None if it is neither a finite number nor one of `_NON_FINITE`'s names."""
    if isinstance(value, str):
        return _NON_FINITE.get(value)
    return float(value) if _is_number(value) else None


def read_manifest(storage: Storage, checkpoint_dir: Path, operation: str = "load") -> Manifest | None:
    """The manifest, None for a directory written without one (the published release), or an error if incomplete
    or damaged, naming the fix for `operation` (the reader's: `on_another`).

    Loads read the manifest through `CheckpointReadContext` (pinned directory, bounded read); this helper serves
    discovery and tools that only look.
    """
    # Looked at first: a writer killed between writing the manifest and removing the marker leaves both.
    marked = storage.exists(checkpoint_dir / INCOMPLETE_MARKER)
    path = checkpoint_dir / MANIFEST_FILE_NAME
    if not storage.exists(path):
        if marked:
            raise incomplete(checkpoint_dir, storage, operation)
        return None
    try:
        data = read_bounded(storage, path)
    except (FileNotFoundError, CorruptCheckpointError) as exc:
        if not _vanished(exc):
            raise
        raise CheckpointReplacedError(
            f"Checkpoint {shown_name(storage, checkpoint_dir)}: its {MANIFEST_FILE_NAME} went between two reads: the "
            f"checkpoint was replaced or deleted meanwhile. Retry (the next read finds the new checkpoint or none)."
        ) from None
    # named by a URL a user can pass on, not `Path`'s `s3:/b`
    manifest = parse_manifest(data, shown_name(storage, path), operation)
    if marked and storage.is_irregular(checkpoint_dir / INCOMPLETE_MARKER):
        raise odd_marker(storage, checkpoint_dir)
    if marked and not _stray_marker(storage, checkpoint_dir, manifest):
        raise incomplete(checkpoint_dir, storage, operation)
    return manifest


def _vanished(exc: BaseException) -> bool:
    """Whether reading a file found a moment before failed because it is gone (on a store: one request found it,
    the next did not; on a local disk: the open, `FileNotFoundError` from `read_local_regular`). That is
    a replace or a deletion in another process, not damage: listings called the checkpoint damaged (and went
    back a step, to an older one), and `verify` said FAILED, of an id a running job had just saved again."""
    return isinstance(exc, FileNotFoundError) or isinstance(exc.__cause__, FileNotFoundError)


def odd_marker(storage: Storage, checkpoint_dir: Path | str) -> UnsafeCheckpointError:
    """The refusal (naming it, and the fix) of an `.incomplete` beside a manifest that is no regular file (a
    FIFO, a directory, a link): the engine never writes one, so it is no delete under way. On `file://` fsspec
    read a FIFO as an empty marker, and gc tried to collect the committed checkpoint as one being deleted."""
    where = Path(checkpoint_dir) / INCOMPLETE_MARKER
    return UnsafeCheckpointError(
        f"Checkpoint {shown_name(storage, checkpoint_dir)} has an {INCOMPLETE_MARKER} ({shown_name(storage, where)}) "
        f"that is not a regular file (a link, a FIFO or a directory): no marker the engine writes, so the "
        f"checkpoint is skipped, not collected. If no other program owns it, remove it; the checkpoint then reads "
        f"as committed."
    )


def shown_name(storage: Storage, path: str | os.PathLike[str]) -> str:
    """`path` as messages name it: on a store without local paths its URL (`memory://root/run/step_1`, what
    `load` and the CLI take, never the bare id relative to the store's root); a local path as it was given."""
    if storage.local_path(Path(path)) is not None:
        return os.fspath(path)
    try:
        return storage.remap_path(Path(path))
    except Exception:  # a message must not fail on a name the store cannot map
        return os.fspath(path)


def incomplete(checkpoint_dir: Path | str, storage: Storage, operation: str = "load") -> IncompleteCheckpointError:
    """The refusal of a checkpoint whose `.incomplete` marker is there. Where saves rename, a final name holds
    one only while a delete of ours runs or after one stopped; on a store without rename a save writes under
    the id itself, behind its marker, so it may be a save still running (which a retry then finds committed).
    The checkpoint is named as the store names it (an object store's URL), not as the bare id; the fix is
    `operation`'s (`on_another`)."""
    path = Path(checkpoint_dir)
    checkpoint_dir = shown_name(storage, checkpoint_dir)
    if storage.atomic_rename:
        return IncompleteCheckpointError(
            f"Checkpoint {checkpoint_dir} is incomplete: its save never committed. {on_another(operation)}"
            + _id_its_name_tells(storage, path)
        )
    return IncompleteCheckpointError(
        f"Checkpoint {checkpoint_dir} is incomplete: on this store a save writes under the id itself, so a save of "
        f"it is still running, or it stopped before it committed (or a delete of it is under way). Retry once "
        f"that save has committed. {on_another(operation)}"
    )


def what_to_pass_instead(storage: Storage, path: Path) -> str:
    """For the error about a directory that is no checkpoint, what the directory says was meant: the checkpoint
    of the id whose save left this temporary or trash name, or the newest checkpoint directly under a run's root.
    Before, both mistakes (`load("runs/exp1")`, a hidden temporary found with `ls -a`) got the path, not the fix,
    and a load with `into=` read the root as a legacy checkpoint and said to fix the item's key. "" otherwise."""
    if hint := _id_its_name_tells(storage, path):
        return hint
    newest = _newest_checkpoint_under(storage, path)
    if newest is None:
        return ""
    shown, (name, count) = shown_name(storage, path), newest
    held = (
        "checkpoints: pass one of them, e.g."
        if count is None
        else f"{count} checkpoint(s): pass one of them, e.g. the newest,"
    )
    return (
        f" It holds {held} {shown_name(storage, path / name)} "
        f"(`torch-checkpointing ls {shown}` lists them; latest_checkpoint({shown!r}) gives the one to resume from)."
    )


def _id_its_name_tells(storage: Storage, path: Path) -> str:
    """The hint a temporary or trash name gives (the id it was a save or a delete of), from the name alone: the
    refusal of an incomplete checkpoint gives this one only. Looking inside for a run's checkpoints there too
    refused each incomplete directory below the same way in turn (RecursionError on nested ones) and read the
    whole tree under every incomplete checkpoint that discovery merely skipped."""
    parent = shown_name(storage, path.parent)
    if m := TMP_RE.match(path.name):
        return (
            f" It is the temporary directory of a save of {parent}/{m['name']} that did not commit (killed, failed or "
            f"still running): load {parent}/{m['name']} (what the last committed save of that id wrote, if any) or "
            f"an earlier checkpoint. `torch-checkpointing gc {parent}` removes it once its save is gone."
        )
    if m := TRASH_RE.match(path.name):
        return (
            f" It is {parent}/{m['name']} being deleted (retention or prune moved it aside): load another checkpoint."
        )
    return ""


# How many entries of a directory the hint of its refusal looks into, those whose names end in the highest steps
# first. Each costs requests on an object store, and the refusal of a long run's root (or of an object-store save's
# prefix still being written: files, no manifest) read every one before it said "not a checkpoint".
HINT_ENTRIES = 16


def _newest_checkpoint_under(storage: Storage, root: Path) -> tuple[str, int | None] | None:
    """The name of the newest (by step, then commit time, then name) committed checkpoint among the first
    `HINT_ENTRIES` entries directly under `root` (by the step their names end with), and how many there are (None
    when not every entry was looked at); None when there is none (or `root` cannot be listed)."""
    found: list[tuple[bool, int, float, str]] = []
    try:
        names = sorted((n for n in storage.ls(root) if not n.startswith(".")), key=_highest_step_first)
    except (OSError, CheckpointError):
        return None
    for name in names[:HINT_ENTRIES]:
        if storage.is_link(root / name):
            continue  # a link: never a checkpoint of this root (hidden names, left out above, are ours in progress)
        try:
            manifest = read_manifest(storage, root / name) if storage.isdir(root / name) else None
        except (OSError, CheckpointError):
            continue
        if manifest is not None:
            step = manifest.step if manifest.step is not None else step_from_name(name)
            found.append((step is not None, step or 0, manifest.commit_time or 0.0, name))
    return (max(found)[3], len(found) if len(names) <= HINT_ENTRIES else None) if found else None


def _highest_step_first(name: str) -> tuple[bool, int, str]:
    step = step_from_name(name)
    return (step is None, -(step or 0), name)


class _OversizedFile(CorruptCheckpointError):
    """An engine file (a manifest, a marker) larger than any the engine writes, refused before it is read.

    Callers see a `CorruptCheckpointError`; `_stray_marker`, which lets go of a marker it cannot read (gone
    meanwhile, a link), tells by this one that is there but too large, and refuses it naming it.
    """


def _stray_marker(storage: Storage, checkpoint_dir: Path, manifest: Manifest) -> bool:
    """Whether the `.incomplete` beside `manifest` is another save's stray claim (`stray_claim`).

    Read as every marker is (`read_marker`): one larger than any claim is refused unread with a
    `CorruptCheckpointError` naming it (before, up to 256 MiB of it was read and parsed as JSON).
    """
    if manifest.claim is None:
        return False
    where = checkpoint_dir / INCOMPLETE_MARKER
    try:
        marker = read_marker(storage, where)
    except _OversizedFile:
        raise CorruptCheckpointError(
            f"Checkpoint {shown_name(storage, checkpoint_dir)} has an {INCOMPLETE_MARKER} "
            f"({shown_name(storage, where)}) larger than {MAX_MARKER_BYTES} bytes, larger than any marker or claim "
            f"of ours: another program's file, or crafted. If no other program owns it, remove it; the checkpoint "
            f"then reads as committed."
        ) from None
    except (OSError, CorruptCheckpointError):  # let go since it was seen, or not a claim (a link, a FIFO)
        return not storage.exists(where)
    return stray_claim(marker, manifest)


def stray_claim(marker: bytes, manifest: Manifest) -> bool:
    """Whether the `.incomplete` marker found beside `manifest` is another save's claim on the id, not the
    commit of this checkpoint left unfinished.

    On an object store the marker is a save's claim (its JSON names the save's token) and the commit removes it
    after writing the manifest, which names the same token. A save that checked the id before that commit and
    claimed it right after (the marker was gone: "create if absent" succeeds) sees the manifest and lets go;
    killed in between, its claim stayed beside a committed checkpoint, which readers refused as incomplete and
    gc deleted whole. A marker naming another token than the manifest's is that claim. An empty marker (a
    delete under way, a rename-mode save) or the manifest's own token is an unfinished commit or delete.
    """
    token = claim_token(marker)
    if manifest.claim is None or token is None or token == manifest.claim:
        return False
    return not (token.startswith(GC_TOKEN_PREFIX) and _collected(marker) in (manifest.claim, UNNAMED_SAVE))


# The token of gc's own claim (`commit.Claim.for_gc`) on a dead save's prefix while it deletes what that save left.
GC_TOKEN_PREFIX = "gc-"

# What gc's claim names as the save it collects when that save's claim named none (an earlier version's empty
# marker): never a save's token, so it owns no manifest, and the claim still reads as gc's (`_collected`).
UNNAMED_SAVE = "an earlier version's save (no token)"


def _collected(marker: bytes) -> str | None:
    """What gc's claim in `marker` collects (`"collects"`: the dead save's token, or `UNNAMED_SAVE`): beside the
    manifest of that save (or of an earlier version's, whose marker named no token), the manifest is on its way
    out, never a checkpoint the claim strayed beside. Before, an earlier version's unfinished save (an empty
    marker, no token to name) held by a gc that was killed was left a committed checkpoint. A gc claim naming
    another save's token beside a manifest still strays: that manifest is another save's commit."""
    claim = _claim_object(marker)
    return (gc_collects(claim) or None) if claim is not None else None


def gc_collects(claim: dict[str, object]) -> str:
    """The `"collects"` of gc's claim `claim` (parsed JSON); '' where it names none (a delete's claim).

    An earlier build's gc wrote no such field at all: it held a dead save's prefix as this build's does, and
    deleted that save's manifest first, so the manifest it was killed beside is the one it collected, which
    named a token it did not record: `UNNAMED_SAVE`. Before, its claim read as a stray claim beside a committed
    checkpoint: the killed save listed and loaded, and the next gc let go of the claim, committing it for good.
    """
    if "collects" not in claim:
        token = claim.get("token")
        return UNNAMED_SAVE if isinstance(token, str) and token.startswith(GC_TOKEN_PREFIX) else ""
    value = claim["collects"]
    return value if isinstance(value, str) else ""


def claim_token(marker: bytes) -> str | None:
    """The save token an `.incomplete` marker's claim names (`commit.Claim`), or None: an empty marker (where
    saves rename, and a delete's) or bytes that are no claim of ours."""
    return _claim_field(marker, "token")


def _claim_field(marker: bytes, name: str) -> str | None:
    """The string field `name` of the claim in `marker`; None where there is none (no JSON object, no such str)."""
    claim = _claim_object(marker)
    value = claim.get(name) if claim is not None else None
    return value if isinstance(value, str) else None


def _claim_object(marker: bytes) -> dict[str, Any] | None:
    """The JSON object in `marker`; None for anything else (not UTF-8, no JSON, no object, or nested past the
    parser's depth: a crafted 10 KB `[[[...` failed the whole gc pass with a bare RecursionError)."""
    try:
        claim = json.loads(marker.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return claim if isinstance(claim, dict) else None


# A claim is a few hundred bytes: a larger `.incomplete` is another program's file, refused unread.
MAX_MARKER_BYTES = 64 * 1024


def our_marker(marker: bytes) -> bool:
    """Whether an `.incomplete` marker's bytes are one we write: empty (where saves rename, and a delete's), or
    a save's claim (`claim_token`). Anything else is another program's file (a download tool's progress), and
    the folder it sits in is not ours to take over or delete."""
    return not marker or claim_token(marker) is not None


def read_marker(storage: Storage, path: Path) -> bytes:
    """The bytes of the `.incomplete` marker at `path`, read as the manifest is (no link, no FIFO, the size
    checked before a byte is read), but refused (CorruptCheckpointError) past `MAX_MARKER_BYTES`: larger than
    any marker of ours, it is another program's file, and reading it whole cost its size in memory."""
    return read_bounded(storage, path, f"an {INCOMPLETE_MARKER} marker of ours", MAX_MARKER_BYTES)


def read_bounded(storage: Storage, path: Path, what: str = "a manifest", limit: int | None = None) -> bytes:
    """Every byte of the engine file at `path` (a manifest, a marker) that no record vouches for, read the one
    way every such read is: its size checked against `limit` (default `MAX_MANIFEST_BYTES`) before a byte is
    read, and on a local disk a regular file opened without following a link or blocking on a FIFO
    (`read_local_regular`); on a store without local paths by its size, then exactly that range
    (`read_stored_bounded`). One helper, so that no reader of such a file picks one half and forgets the other.
    """
    local = storage.local_path(path)
    if local is not None:
        return read_local_regular(local, path, what, limit)
    return read_stored_bounded(storage, path, what, limit)


def read_stored_bounded(storage: Storage, path: Path, what: str = "a manifest", limit: int | None = None) -> bytes:
    """Every byte of an engine file on a store with no local path (an object store), its size checked first
    against `limit` (default `MAX_MANIFEST_BYTES`).

    The size and the bytes come from one version of the file (`Storage.read_sized`), and no more than `limit`
    bytes are read, so a crafted 300 MiB manifest is refused unread instead of downloaded whole (29 s and its
    size in memory on S3).
    """
    limit = MAX_MANIFEST_BYTES if limit is None else limit
    if storage.is_irregular(path):  # `file://`: fsspec sizes a FIFO 0 bytes and reads through a link
        raise UnsafeCheckpointError(f"{shown_name(storage, path)} is not a regular file; it cannot be {what}.")
    size, data = storage.read_sized(path, limit)
    if data is None:
        raise _OversizedFile(f"{path} is {size} bytes, larger than {limit}; it is not {what}.")
    return data


def read_local_regular(local: str, path: Path | str, what: str = "a manifest", limit: int | None = None) -> bytes:
    """The bytes of a local engine file (a manifest, a marker) that is a regular file of at most `limit` bytes
    (`read_regular_file`), never blocking: a FIFO or a symlink is refused.

    A file not there is a `FileNotFoundError` naming it, as every store's read of one is (a deletion or a replace
    in another process took it since it was found), and a process out of descriptors says so: both were a
    `CorruptCheckpointError` ("Cannot open"), damage, which callers had to undo by looking at its cause."""
    try:
        fd = os.open(local, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeCheckpointError(f"{path} is a symbolic link; it cannot be {what}.") from None
        if isinstance(exc, PermissionError):
            raise unreadable_file(path, what, exc) from exc
        if isinstance(exc, FileNotFoundError):
            raise FileNotFoundError(
                exc.errno, f"{path} ({what}) is not there: removed or replaced since it was found", str(path)
            ) from exc
        raise_if_short_of_resources(exc, path, what)
        raise CorruptCheckpointError(f"Cannot open {path}: {exc}") from exc
    try:
        return read_regular_file(fd, path, what, limit)
    finally:
        os.close(fd)


def read_regular_file(fd: int, path: Path | str, what: str = "a manifest", limit: int | None = None) -> bytes:
    """Every byte of an opened engine file (the manifest), refused unless regular and at most `limit` bytes
    (default `MAX_MANIFEST_BYTES`).

    No record can vouch for the manifest itself, so its type and size are what is checked before reading it.
    What is asked for is the size fstat gave (a read of n bytes allocates n up front: asking for `limit + 1`
    cost 256 MiB per manifest read), and more only if the file grew meanwhile. Read from `fd` itself: a
    duplicate of it took a second descriptor, and a process with one left failed "[Errno 24]", naming nothing.
    """
    limit = MAX_MANIFEST_BYTES if limit is None else limit
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCheckpointError(f"{path} is not a regular file; it cannot be {what}.")
    if st.st_size > limit:
        raise _OversizedFile(f"{path} is larger than {limit} bytes; it is not {what}.")
    data = _read_up_to(fd, st.st_size + 1)
    if len(data) > st.st_size:  # it grew since fstat: read on, to the limit
        data += _read_up_to(fd, limit + 1 - len(data))
    if len(data) > limit:
        raise _OversizedFile(f"{path} is larger than {limit} bytes; it is not {what}.")
    return data


def _read_up_to(fd: int, size: int) -> bytes:
    """`size` bytes from `fd`'s offset on, fewer only at the end of the file (`os.read` may return fewer)."""
    chunks: list[bytes] = []
    while size > 0 and (chunk := os.read(fd, size)):
        chunks.append(chunk)
        size -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# ------------------------------------------------------------------------------------------------ parsing

MAX_MANIFEST_BYTES = 256 * 1024 * 1024
_MAX_DEPTH = 16


def parse_manifest(text: str | bytes, where: str, operation: str = "load") -> Manifest:
    """A validated `Manifest` from untrusted JSON; every defect raises `CorruptCheckpointError` naming the field
    and the fix for `operation` (the reader's, `on_another`): every one said "Load an earlier checkpoint", also to
    an export, a CLI command and a listing."""
    try:
        return _parsed(text, where)
    except (NewerCheckpointError, CheckpointReplacedError):
        raise  # no damage: its own fix
    except CorruptCheckpointError as exc:
        exc.args = (f"{exc} {on_another(operation)}",)
        raise


def _parsed(text: str | bytes, where: str) -> Manifest:
    """`parse_manifest`, a damaged manifest's refusal without its fix."""
    if len(text) > MAX_MANIFEST_BYTES:  # no engine writes one: another tool's
        raise _foreign(where, f"it is larger than the {MAX_MANIFEST_BYTES} bytes of any manifest of ours")
    try:
        d = _loads(text, where)
    except CorruptCheckpointError:
        if not _names_our_fields(text):
            raise _foreign(where, "its bytes are no JSON object and name no field of ours") from None
        raise  # ours, damaged: a write cut short, bytes changed
    if not isinstance(d, dict):
        raise _foreign(where, f"it is a JSON {type(d).__name__}, not an object")
    if d.get("kind") != _KIND:
        if d.keys() >= _OUR_SHAPE:  # ours with a changed byte in 'kind': skipped as another tool's, latest went back
            raise CorruptCheckpointError(
                f"{where}: field 'kind' is {d.get('kind')!r}, not {_KIND!r}, in a manifest with every other field "
                f"of ours ({', '.join(sorted(_OUR_SHAPE))}): the manifest is damaged."
            )
        raise _foreign(where, f"kind={d.get('kind')!r}")
    newer = _written_by_a_newer_engine(d)
    try:
        manifest = _parse_fields(d, where)
        if not newer:
            check_formats_known(manifest, where)
        return manifest
    except NewerCheckpointError as exc:
        if newer:
            raise
        raise CorruptCheckpointError(
            f"{exc.record}, which this engine does not know, yet its field 'library_version' "
            f"({d.get('library_version')!r}) says an engine no newer than this one ({__version__}) wrote it, and "
            f"this engine reads everything such an engine writes: the manifest is damaged (a changed byte), not a "
            f"newer engine's."
        ) from None


def _written_by_a_newer_engine(d: dict[str, Any]) -> bool:
    """Whether the manifest declares a newer engine wrote it ('library_version' above this engine's). Only then
    may a version or a name this engine does not know be a newer engine's: the manifest has no checksum, so a
    changed byte in 'TorchSerialization' or 'manifest_version' of our own manifest reads as an unknown name, and
    calling that 'a newer engine's, do not delete it' keeps a damaged checkpoint as a healthy one. This engine's
    own version unknown (an uninstalled tree), any version declared counts as newer: never called damage."""
    theirs, ours = _release(d.get("library_version")), _release(__version__)
    return theirs is not None and (ours is None or theirs > ours)


def _release(version: object) -> tuple[int, ...] | None:
    """The numeric release of a version string ('0.3.0' of '0.3.0rc1+abc'), or None where it has none."""
    found = re.match(r"[0-9]{1,9}(?:\.[0-9]{1,9})*", version) if isinstance(version, str) else None
    return None if found is None else tuple(int(part) for part in found.group().split("."))


def check_formats_known(manifest: Manifest, where: str) -> None:
    """Raise the `NewerCheckpointError` of a record whose format this engine does not know, for `parse_manifest`
    to judge; any other defect of a record's format is refused when its file is read, as before."""
    for rec in manifest.files:
        try:
            rec.serialization_format(where)
        except NewerCheckpointError:
            raise
        except CorruptCheckpointError:
            continue


def _parse_fields(d: dict[str, Any], where: str) -> Manifest:
    """The manifest's fields, each validated (a `NewerCheckpointError` is judged by `parse_manifest`)."""
    _check_version(d, where)
    world_size = _int(d, "world_size", where, minimum=1, maximum=MAX_WORLD_SIZE)
    files: list[FileRecord] = []
    items = _field(d, "items", dict, where)
    for key, per_rank in items.items():
        if not isinstance(per_rank, dict):
            raise CorruptCheckpointError(f"{where}: field 'items.{key}' must be an object of rank -> file record.")
        for rank_text, rec in per_rank.items():
            record = _record(rec, key, rank_text, f"{where}: field 'items.{key}.{rank_text}'")
            if record.rank >= world_size:
                raise CorruptCheckpointError(
                    f"{where}: field 'items.{key}.{rank_text}' is a file of rank {record.rank}, but the checkpoint "
                    f"was saved by {world_size} rank(s) (field 'world_size'); this manifest is not what its save wrote."
                )
            files.append(record)
    metadata_file = _optional(d, "metadata_file", str, where)
    _check_one_record_per_file(files, metadata_file, where)
    recorded = _optional(d, "metrics", dict, where)
    metrics = None if recorded is None else {str(k): _metric_value(v) for k, v in recorded.items()}
    if metrics is not None and any(v is None for v in metrics.values()):
        raise CorruptCheckpointError(
            f'{where}: field \'metrics\' must map names to numbers (or "NaN", "Infinity", "-Infinity").'
        )
    metadata_size, metadata_crc32 = _metadata_record(d, metadata_file, where)
    commit_time = _optional(d, "commit_time", (int, float), where)
    if commit_time is not None and not _is_number(commit_time):  # JSON's 1e400 parses as infinity
        raise CorruptCheckpointError(f"{where}: field 'commit_time' must be a finite number, got {commit_time!r}.")
    return Manifest(
        world_size,
        _field(d, "library_version", str, where),
        tuple(files),
        metadata_file,
        _optional_int(d, "step", where),
        cast("dict[str, float] | None", metrics),
        None if commit_time is None else float(commit_time),
        metadata_size,
        metadata_crc32,
        _optional(d, "claim", str, where),
    )


# A top-level field of the manifest as the writer spells it (`Manifest.to_json`), or the start of a JSON object (all
# a manifest cut within its first field keeps): what tells a manifest of ours, damaged past parsing, from another
# tool's file (other text, a JSON array). An empty one counts as ours: a crash that kept the rename but not the
# bytes leaves exactly that, and another tool's empty `manifest.json` beside a root's checkpoints is far rarer.
_OUR_FIELD = re.compile(
    rb'"(?:kind|manifest_version|library_version|world_size|metadata_file|items|step|metrics|commit_time|'
    rb'metadata_size|metadata_crc32|claim)"\s*:'
)


# The fields every manifest of ours holds beside 'kind' (a browser extension's has 'manifest_version' too).
_OUR_SHAPE = frozenset({"items", "world_size", "library_version", "manifest_version"})


def _names_our_fields(text: str | bytes) -> bool:
    data = (text.encode("utf-8", "replace") if isinstance(text, str) else text).strip()
    return not data or data.startswith(b"{") or _OUR_FIELD.search(data) is not None


def _foreign(where: str, why: str) -> ForeignManifestError:
    """The refusal of a `manifest.json` no engine of ours wrote: the directory is not a checkpoint (never damage:
    a script that deletes damaged checkpoints would delete another tool's folder)."""
    return ForeignManifestError(
        f"{where} is not a torch_checkpointing manifest ({why}): the directory is another tool's, not a "
        f"checkpoint (not damaged; do not delete it as one). Pass the path of a checkpoint of ours."
    )


def _metadata_record(d: dict[str, Any], metadata_file: str | None, where: str) -> tuple[int | None, int | None]:
    """The sharding metadata's size and CRC32: both (what the writer records with 'metadata_file'), or neither (a
    manifest from before they existed: read unchecked). One alone, or either without 'metadata_file', would
    leave the metadata unchecked under verify_checksums=True, silently: refused, naming the field."""
    size, crc = _optional_int(d, "metadata_size", where), _optional_int(d, "metadata_crc32", where)
    if size is None and crc is None:
        return None, None
    if metadata_file is None:
        raise CorruptCheckpointError(
            f"{where}: fields 'metadata_size'/'metadata_crc32' describe a metadata file, but field 'metadata_file' "
            f"names none; the manifest is damaged or crafted."
        )
    if size is None or crc is None:
        missing = "metadata_size" if size is None else "metadata_crc32"
        raise CorruptCheckpointError(
            f"{where}: required field '{missing}' is missing beside the other half of the metadata file's record; "
            f"without it {metadata_file!r} could not be verified. The manifest is damaged or crafted."
        )
    if crc > 0xFFFFFFFF:
        raise CorruptCheckpointError(f"{where}: field 'metadata_crc32' is not a 32-bit value.")
    return size, crc


def _check_one_record_per_file(files: list[FileRecord], metadata_file: str | None, where: str) -> None:
    """Refuse a file listed twice (two records, or a record and 'metadata_file'), paths compared normalised.

    The writer never lists one (`checkpoint_writer._check_distinct`), and readers look records up by path: with
    two, one of them was silently dropped, so an item was checked against another record and read another
    item's file (as a JSON object naming a key twice is refused, `unique_keys`)."""
    owners: dict[str, str] = {}
    named = [(f"items.{r.key}.{r.rank}", r.path) for r in files]
    if metadata_file is not None:
        named.append(("metadata_file", metadata_file))
    for field_name, path in named:
        normal = posixpath.normpath(path)
        first = owners.setdefault(normal, field_name)
        if first != field_name:
            raise CorruptCheckpointError(
                f"{where} lists file {normal!r} twice (fields '{first}' and '{field_name}'); a save lists each file "
                f"once, so the manifest is damaged or crafted."
            )


def _check_version(d: dict[str, Any], where: str) -> None:
    """Refuse a manifest of a version this engine does not read: its fields may mean something else (a newer
    engine's), and reading it as ours could return other values than were saved, silently."""
    version = _field(d, "manifest_version", int, where)
    if version > MANIFEST_VERSION:
        shown = version if version.bit_length() < 64 else f"a {version.bit_length()}-bit number"
        raise NewerCheckpointError(
            f"{where}: field 'manifest_version' is {shown}; this engine reads version {MANIFEST_VERSION}. A newer "
            f"engine wrote this checkpoint: load it with that engine or a newer one (it is not damaged; do not "
            f"delete it).",
            record=f"{where} records field 'manifest_version' as {shown}",
        )
    if version != MANIFEST_VERSION:
        raise CorruptCheckpointError(
            f"{where}: field 'manifest_version' is {version}, which no engine writes (this one writes "
            f"{MANIFEST_VERSION}); the manifest is damaged or crafted."
        )


def _loads(text: str | bytes, where: str) -> Any:
    try:
        raw = text.decode("utf-8") if isinstance(text, bytes) else text
        value = json.loads(raw, parse_constant=_BadConstant, object_pairs_hook=unique_keys)
    except DuplicateKeyError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}.") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({type(exc).__name__}: {exc}).") from None
    check_json_tree(value, where, _MAX_DEPTH)
    return value


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice (raised while parsing, so the caller's message names its file)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`' `object_pairs_hook` for checkpoint data: an object naming a key twice is refused. The
    engine's writers never repeat a key, and `json.loads` alone keeps the last value silently, so one reader
    could check the first value and another use the second."""
    value = dict(pairs)
    if len(value) == len(pairs):
        return value
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise DuplicateKeyError(f"field {key!r} appears twice in one object; the file is damaged or crafted")
        seen.add(key)
    return value


class _BadConstant(str):
    """Stands in for NaN/Infinity while parsing, so the check can name the field that holds it."""


def check_json_tree(value: Any, where: str, max_depth: int) -> None:
    """Refuse JSON nested deeper than `max_depth` or holding NaN/Infinity, naming the field (iteratively)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            raise CorruptCheckpointError(
                f"{where}: field '{path}' nests deeper than {max_depth} levels; the file is damaged or crafted."
            )
        if isinstance(node, _BadConstant):
            raise CorruptCheckpointError(
                f"{where}: field '{path}' holds the non-standard JSON constant {node!s}; the file is damaged or "
                f"crafted."
            )
        if isinstance(node, dict):
            stack.extend((v, depth + 1, f"{path}.{k}" if path else str(k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node))


def _is_number(v: Any) -> bool:
    """A finite JSON number that a float holds (an int of 400 digits does not: float() overflows)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _field(d: dict[str, Any], name: str, kind: Any, where: str) -> Any:
    if name not in d:
        raise CorruptCheckpointError(f"{where}: required field '{name}' is missing.")
    value = d[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CorruptCheckpointError(f"{where}: field '{name}' has the wrong type ({type(value).__name__}).")
    return value


def _optional(d: dict[str, Any], name: str, kind: Any, where: str) -> Any:
    return None if d.get(name) is None else _field(d, name, kind, where)


def _int(d: dict[str, Any], name: str, where: str, minimum: int = 0, maximum: int | None = None) -> int:
    value = _field(d, name, int, where)
    if value < minimum:
        raise CorruptCheckpointError(f"{where}: field '{name}' is {value}, below {minimum}.")
    if maximum is not None and value > maximum:
        shown = value if value.bit_length() < 64 else f"a {value.bit_length()}-bit number"
        raise CorruptCheckpointError(f"{where}: field '{name}' is {shown}, above {maximum}; the file is crafted.")
    return int(value)


def _optional_int(d: dict[str, Any], name: str, where: str) -> int | None:
    return None if d.get(name) is None else _int(d, name, where)


def _record(rec: Any, key: str, rank_text: str, where: str) -> FileRecord:
    if not isinstance(rec, dict):
        raise CorruptCheckpointError(f"{where} must be a file record object.")
    record = FileRecord(
        _field(rec, "key", str, where),
        _int(rec, "rank", where),
        _field(rec, "path", str, where),
        _int(rec, "size", where),
        _int(rec, "crc32", where),
        _field(rec, "format", dict, where),
    )
    if rec.get("blocks") is not None:
        record = dataclasses.replace(record, blocks=BlockChecksums.from_json(rec["blocks"], record.size, where))
    if record.key != key or str(record.rank) != rank_text:
        raise CorruptCheckpointError(f"{where} records key {record.key!r} rank {record.rank}; it is filed elsewhere.")
    if record.crc32 > 0xFFFFFFFF:
        raise CorruptCheckpointError(f"{where}: field 'crc32' is not a 32-bit value.")
    _refuse_reserved_path(record.path, where)
    return record


# The names the engine writes at the top of a checkpoint besides item files (commit.RESERVED_FILE_NAMES, which a
# layout may not use; spelled here because the module naming the metadata file imports this one).
_RESERVED_TOP = frozenset({MANIFEST_FILE_NAME, INCOMPLETE_MARKER, "metadata.json"})


def _refuse_reserved_path(path: str, where: str) -> None:
    """A record whose file is (or lies under) a reserved name is no save's: a layout using one is refused at save
    time. Read as an item's file, the manifest itself was checked against the item's record and the load blamed
    the caller's layout; `inspect` listed it and exited 0."""
    normal = posixpath.normpath(path)
    top = normal.split("/")[0]
    if top in _RESERVED_TOP:
        under = "" if normal == top else f", under {top!r}"
        raise CorruptCheckpointError(
            f"{where}: field 'path' is {path!r}{under}, a name the engine reserves for its own files; no save "
            f"records an item's file there, so the manifest is damaged or crafted."
        )
