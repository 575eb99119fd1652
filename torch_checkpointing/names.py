"""Hidden sibling names the engine gives a checkpoint's directory while it is replaced or deleted.

Every name here must fit one path component (NAME_MAX bytes): an id's own name may use all 255 bytes, so its
name part is cut, at a UTF-8 character boundary, the way `commit.temporary_name` cuts a save's temporary name.
The prefix and suffix stay whole, so `discovery`'s patterns (and therefore gc) still recognise a cut name; the
id it belonged to is then found by cutting each sibling's name the same way (`cut_from`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable

__all__ = [
    "ASIDE_RE",
    "NAME_MAX",
    "aside_name",
    "aside_of",
    "cut_from",
    "fit_name",
    "may_be_cut",
    "previous_copy_hint",
    "trash_name",
]

NAME_MAX = 255  # bytes in one path component on Linux filesystems
_MAX_CHAR_BYTES = 4  # a cut at a character boundary drops at most 3 bytes more than it must


def fit_name(prefix: str, name: str, suffix: str) -> str:
    """`prefix + name + suffix`, `name` shortened so that the whole is at most NAME_MAX bytes."""
    room = NAME_MAX - len(os.fsencode(prefix + suffix))
    raw = os.fsencode(name)
    if len(raw) > room:
        name = raw[:room].decode("utf-8", errors="ignore")
    return f"{prefix}{name}{suffix}"


ASIDE_RE = re.compile(r"^\.old_(?P<name>.+)_(?P<pid>[0-9]+)$")  # what `aside_name` makes


def aside_name(name: str, pid: int) -> str:
    """Where the non-exchange replace moves the old checkpoint `name` while the new one moves in."""
    return fit_name(".old_", name, f"_{pid}")


def aside_of(hidden: str, siblings: Iterable[str]) -> str | None:
    """The id the aside copy `hidden` was moved from: its name part, or for a cut name the sibling it was cut
    from; None when `hidden` is no aside name, or a cut one whose id is not among `siblings`."""
    match = ASIDE_RE.match(hidden)
    if match is None:
        return None
    if not may_be_cut(hidden):
        return match["name"]
    pid = int(match["pid"])
    return cut_from(hidden, siblings, lambda sibling: aside_name(sibling, pid))


def trash_name(name: str, pid: int, nonce: str) -> str:
    """What retention and gc rename a directory to before removing it (never listed as a checkpoint)."""
    return fit_name(".", name, f".trash-{pid}-{nonce}")


def may_be_cut(hidden: str) -> bool:
    """Whether `hidden` is long enough that its name part may have been shortened (a shorter one never was)."""
    return len(os.fsencode(hidden)) > NAME_MAX - _MAX_CHAR_BYTES


def cut_from(hidden: str, siblings: Iterable[str], make: Callable[[str], str]) -> str | None:
    """The sibling whose hidden name (`make(sibling)`) is `hidden`: the id a cut name belonged to, if present."""
    return next((s for s in siblings if make(s) == hidden), None)


def previous_copy_hint(local: str) -> str:
    """Where a replace that died between its two renames left the previous checkpoint of this id, if it did.

    The fallback replace (no atomic exchange, e.g. NFS) moves the old checkpoint aside before moving the new one
    in; a kill in between leaves the id empty and its committed copy beside it, which gc moves back.
    """
    parent, name = os.path.split(os.path.abspath(local))
    try:
        entries = os.listdir(parent)
    except OSError:
        return ""
    for entry in entries:
        match = ASIDE_RE.match(entry)
        if match and aside_name(name, int(match["pid"])) == entry:
            return (
                f" Its previous checkpoint is at {os.path.join(parent, entry)}: a save that replaced it was killed "
                f"before the new one moved in. Run `torch-checkpointing gc {parent}` to move it back, then load."
            )
    return ""
