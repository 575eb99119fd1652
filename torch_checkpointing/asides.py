"""When a copy that a replace moved aside goes back under its id: the one rule for every caller.

The non-exchange replace (`Storage.replace_directory`'s fallback) moves the old checkpoint to an aside name
(`names.aside_name`) before moving the new one in; a kill between the two renames leaves nothing at the id. Both
the trainer that settles its dead writer (`commit.Commit.adopt`) and gc (`retention.collect_garbage`) put such a
copy back. They decided apart before, on less than a load needs, and disagreed: gc put back the first copy in name
order (an older checkpoint, deleting the newer one beside it), and both put back copies whose files were not all
there. Here: a copy goes back only onto an id that holds nothing (not even a link), only when no copy of the id
may still be in a live replace's hands, only when a load would read it whole, and of several the one committed
last, strictly; anything else puts nothing back and says why. A copy whose name was cut to fit is one only for
the trainer of the dead writer that made it: two long ids that differ past the cut make the same cut names, and
the manifest does not record its id, so any other copy so named may be another id's checkpoint. And for that
trainer, its dead writer's one whole copy is the one: what the id held when the writer died, whichever commit
time another copy records (a save while the clock was ahead, stepped back since, records a later one).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch_checkpointing.discovery import checkpoint_info, hidden_name_alive, problem_with, still_there
from torch_checkpointing.errors import (
    UNREADABLE_BY_THIS_USER,
    CheckpointError,
    ObjectStoreError,
    raise_if_short_of_resources,
)
from torch_checkpointing.names import ASIDE_RE, DEFAULT_UNOWNED_AGE_S, aside_of, made_here, may_be_cut
from torch_checkpointing.storage.base_storage import Storage, writing_nothing

__all__ = ["PutBack", "await_replaced", "copies_aside", "copy_to_put_back", "made_by", "owner_pid", "replace_under_way"]


@dataclass(frozen=True)
class PutBack:
    """The copy to move back under the id (None: none), every copy of the id found aside, why none is chosen, and
    whether the id holds nothing (a copy of an id taken since is garbage or a user's to judge, not put back)."""

    chosen: Path | None
    copies: list[Path] = field(default_factory=list)
    why_not: str = ""
    id_free: bool = True


def copies_aside(storage: Storage, final: Path) -> list[Path]:
    """Every copy a replace moved aside from the id `final`, cut names included (the id is known here)."""
    return [
        final.parent / n
        for n in sorted(storage.ls(final.parent))
        if ASIDE_RE.match(n) is not None and aside_of(n, [final.name]) == final.name
    ]


def copy_to_put_back(
    storage: Storage, final: Path, dead_pid: int | None = None, unowned_after_s: float = DEFAULT_UNOWNED_AGE_S
) -> PutBack:
    """Which copy aside goes back under the id `final` now (see the module's docstring). `dead_pid`: a process
    of this host the caller knows is dead (a writer it saw die), whose pid may have been given to another process
    since. A copy another host moved aside may be in its replace's hands until it is `unowned_after_s` old: its
    pid names no process here."""
    copies = copies_aside(storage, final)
    if not copies:
        return PutBack(None, copies, "no copy of it is aside")
    if still_there(storage, final):  # anything, a dangling link included
        return PutBack(None, copies, "something is at the id", id_free=False)
    live = [c for c in copies if _owner_may_live(storage, c, dead_pid, unowned_after_s)]
    if live:
        return PutBack(None, copies, f"the replace that moved {live[0]} aside may still be running")
    ours = [c for c in copies if not may_be_cut(c.name) or made_by(c, dead_pid)]
    whole = {c: t for c in ours if (t := _commit_time_if_whole(storage, c)) is not None}
    if not whole:
        return PutBack(None, copies, "none of them is a whole checkpoint whose name tells it is of this id")
    its = [c for c in whole if made_by(c, dead_pid)]
    if len(its) == 1:  # what the id held when that writer died: known without comparing clocks
        return PutBack(its[0], copies)
    newest = max(whole, key=lambda c: whole[c])
    if sum(t >= whole[newest] for t in whole.values()) > 1:
        return PutBack(None, copies, "no one of them was committed last (their commit times tie or are unknown)")
    return PutBack(newest, copies)


REPLACE_GAP_WAIT_S = 2.0
"""How long a reader of an empty id waits for a replace without an atomic exchange to move its new copy in."""
_REPLACE_GAP_POLL_S = 0.01
REPLACE_GAP_MAX_AGE_S = 60.0
"""How long ago a copy may have been moved aside and still be a replace between its two renames, which follow each
other at once (the margin is for a slow filesystem); measured on the file server's clock, which set the rename's
ctime (`_age_s`)."""


def replace_under_way(storage: Storage, final: Path) -> Path | None:
    """A copy of the id `final` aside that a live replace may still hold (between its two renames, the new copy
    moves in next), or None: none is aside, or only ones a killed replace left (gc puts those back), or the parent
    cannot be listed (gone too: nothing was moved aside from it). A copy moved aside more than
    `REPLACE_GAP_MAX_AGE_S` ago is no replace between its renames, whoever holds its pid: before, another host's
    (or an earlier container's) killed replace, whose owner cannot be told dead here, made every load of the id
    wait and then say "being replaced ... load it again in a moment" for the day gc keeps such a copy."""
    try:
        copies = copies_aside(storage, final)
    except OSError as exc:  # short of descriptors, a load in a replace's gap said the checkpoint did not exist
        raise_if_short_of_resources(exc, final.parent, "the check whether a replace of it is under way")
        return None
    # A load or listing of a store that is no local filesystem writes no probe of its clock there (S3: an answer's
    # `Date`); a local one keeps its probe, an unnamed file or, on NFS, the server's only clock a host can read.
    remote = storage.local_path(final) is None
    with writing_nothing() if remote else contextlib.nullcontext():
        in_gap = [c for c in copies if _age_s(storage, c) < REPLACE_GAP_MAX_AGE_S]
        return next((c for c in in_gap if _owner_may_live(storage, c, None, DEFAULT_UNOWNED_AGE_S)), None)


def await_replaced(storage: Storage, final: Path, shown: str) -> None:
    """Return once something is at the id `final`, which held nothing, while a live replace holds a copy of it
    aside (between its two renames: the new copy moves in next), at most `REPLACE_GAP_WAIT_S`; return at once
    when no live replace holds one. Still empty at the end: a FileNotFoundError saying a save is replacing it.

    Before, a load or `verify` in that gap said the checkpoint did not exist, and that the save replacing it had
    been killed (it was alive): a job that resumes when its checkpoint is there started over, and `verify || rm`
    removed the save that landed right after."""
    deadline = time.monotonic() + REPLACE_GAP_WAIT_S
    while (copy := replace_under_way(storage, final)) is not None:
        time.sleep(_REPLACE_GAP_POLL_S)
        if storage.exists(final):
            return
        if time.monotonic() >= deadline:
            raise FileNotFoundError(
                f"Checkpoint path {shown} does not exist: it is being replaced by a save that did not finish "
                f"within {REPLACE_GAP_WAIT_S:g} s (its previous copy is aside at {copy}; the new copy moves in "
                f"next). Load it again in a moment."
            )


def owner_pid(copy: Path) -> int:
    """The pid of the process whose replace moved `copy` aside (one of `copies_aside`)."""
    match = ASIDE_RE.match(copy.name)
    if match is None:
        raise ValueError(f"{copy} is no copy a replace moved aside")
    return int(match["pid"])


def made_by(copy: Path, pid: int | None) -> bool:
    """Whether `copy` (one of `copies_aside`) was moved aside by process `pid` of this host."""
    match = ASIDE_RE.match(copy.name)
    return match is not None and pid is not None and int(match["pid"]) == pid and made_here(match)


def _owner_may_live(storage: Storage, copy: Path, dead_pid: int | None, unowned_after_s: float) -> bool:
    match = ASIDE_RE.match(copy.name)
    if match is None or made_by(copy, dead_pid):
        return False
    alive = hidden_name_alive(match, copy, storage)
    return alive if alive is not None else _age_s(storage, copy) < unowned_after_s


def _age_s(storage: Storage, copy: Path) -> float:
    """How long ago `copy` last changed, its move aside included (`Storage.changed_at`: a local path's ctime, an
    object store's newest LastModified under it), on the clock that stamped it (`Storage.store_now`: by this
    host's, a host ahead of its server took another host's live replace's copy for an old one, and gc put the old
    copy back under it); 0 when that cannot be told, so that it counts as young. Before, a copy on an object store
    was always 0 s old: every load of its empty id waited for a replace for good, and gc never put another host's
    copy back."""
    try:
        named = storage.changed_at(copy)  # first: a copy that is not there probes no folder
    except ObjectStoreError:  # the store failed the read: not "young", which kept the copy and said nothing
        raise
    except (OSError, CheckpointError):
        return 0.0
    return 0.0 if named is None else storage.store_now(copy.parent) - named


def _commit_time_if_whole(storage: Storage, path: Path) -> float | None:
    """The commit time of `path` when a load would read it whole (a directory, not a link, its manifest ours and
    every file it lists there at its recorded size), -inf when that time is unknown; None when it is not whole.
    This process short of memory or descriptors is raised (`errors.raise_if_short_of_resources`), and so is a
    copy this user may not read, or a newer engine wrote (`_unknowable`): nothing is known of the copy then, and
    read as "not whole" it had gc put back an older copy and delete this one."""
    if storage.is_link(path):
        return None
    try:
        problem = problem_with(path, storage)
        info = None if problem is not None else checkpoint_info(path, storage)
    except (OSError, CheckpointError) as exc:
        raise_if_short_of_resources(exc, path, "the check that a copy aside is whole")
        if isinstance(exc, PermissionError):  # its directory, listed by the store before the check: no damage
            raise _unknowable(path, str(exc), closed=True) from exc
        return None
    if problem is not None and problem.unreadable:
        raise _unknowable(path, problem.text, closed=UNREADABLE_BY_THIS_USER in problem.text)
    if info is None:
        return None
    return info.commit_time if info.commit_time is not None else float("-inf")


def _unknowable(path: Path, why: str, *, closed: bool) -> OSError:
    """The refusal to choose among copies aside when `path`, one of them, cannot be judged here: it may be the one
    committed last. A `PermissionError` where this user may not read it (`closed`), else an `OSError` (a newer
    engine's copy)."""
    return (PermissionError if closed else OSError)(
        f"which copy aside was committed last cannot be told, so none is put back: {path} cannot be judged here "
        f"({why.rstrip('.')}). Run gc as a user that may read every copy (or with the engine that wrote it)"
    )
