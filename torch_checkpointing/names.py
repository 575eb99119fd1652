"""Hidden sibling names the engine gives a checkpoint's directory while it is replaced or deleted.

Every name here must fit one path component (NAME_MAX bytes): an id's own name may use all 255 bytes, so its
name part is cut, at a UTF-8 character boundary, the way `commit.temporary_name` cuts a save's temporary name.
The prefix and suffix stay whole, so `discovery`'s patterns (and therefore gc) still recognise a cut name; the
id it belonged to is then found by cutting each sibling's name the same way (`cut_from`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterable

__all__ = [
    "ASIDE_RE",
    "CLOCK_PROBE_RE",
    "CREATING_RE",
    "DEFAULT_UNOWNED_AGE_S",
    "NAME_MAX",
    "PATH_MAX",
    "TMP_RE",
    "TRASH_RE",
    "aside_name",
    "aside_of",
    "creating_name",
    "cut_from",
    "fit_name",
    "held_here",
    "holding",
    "host_tag",
    "made_here",
    "may_be_cut",
    "new_nonce",
    "pid_alive",
    "pid_namespace",
    "previous_copy_hint",
    "same_host",
    "step_from_name",
    "this_host",
    "trash_name",
]

NAME_MAX = 255  # bytes in one path component on Linux filesystems
PATH_MAX = 4096  # bytes in a path a system call takes on Linux, its terminating NUL included
_MAX_CHAR_BYTES = 4  # a cut at a character boundary drops at most 3 bytes more than it must


def fit_name(prefix: str, name: str, suffix: str) -> str:
    """`prefix + name + suffix`, `name` shortened so that the whole is at most NAME_MAX bytes."""
    room = NAME_MAX - len(os.fsencode(prefix + suffix))
    raw = os.fsencode(name)
    if len(raw) > room:
        name = raw[:room].decode("utf-8", errors="ignore")
    return f"{prefix}{name}{suffix}"


# Names the engine gives to directories that are not (yet, or any more) a checkpoint: checkpoint_manager.py names
# temporary directories `.{name}.tmp-{uid}-{seq}`, and retention renames a checkpoint it deletes to
# `.{name}.trash-{pid}-{nonce}` before removing it (`aside_name` below makes the third kind).
TMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<uid>[0-9a-f]+)-(?P<seq>[0-9]+)$")
TRASH_RE = re.compile(r"^\.(?P<name>.+)\.trash-(?P<pid>[0-9]+)-(?P<nonce>[0-9a-f]+)(?:-(?P<host>[0-9a-f]{8}))?$")

# How old a leftover whose maker cannot be checked from here (another host's) must be before it counts as gone:
# no save, replace or delete takes a day.
DEFAULT_UNOWNED_AGE_S = 24 * 3600.0


# Where a marker's bytes are written before they are linked under its name, on a filesystem without O_TMPFILE
# (`.{name}.creating-{pid}-{nonce}-{host}`, beside the marker): a creator killed before its link or its unlink
# leaves one, which the next creator of the marker removes (`fsspec_storage._remove_dead_creations`).
CREATING_RE = re.compile(r"^\.(?P<name>.+)\.creating-(?P<pid>[0-9]+)-(?P<nonce>[0-9a-f]{8})-(?P<host>[0-9a-f]{8})$")

# A probe of a store's clock (`base_storage.clock_probe_name`, an empty file or object removed at once): one a
# killed prober left is collected by gc (`discovery._probe_leftover`).
CLOCK_PROBE_RE = re.compile(r"^\.clock-probe-(?P<pid>[0-9]+)-(?P<nonce>[0-9a-f]{8})-(?P<host>[0-9a-f]{8})$")


def creating_name(name: str) -> str:
    """This process's hidden name for the bytes of `name` while it creates it (`CREATING_RE`)."""
    return f".{name}.creating-{os.getpid()}-{new_nonce()}-{host_tag()}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (a pid reused since is counted alive: the safe side).

    A pid no process can have is no process: `os.kill` reads 0 and below as process groups (0: our own, always
    there, so a claim holding it was "alive"), and one past a C pid_t raised a bare OverflowError from gc and
    from every save of the id (a claim or hidden name holds what its writer, or a hand, put there)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def step_from_name(name: str) -> int | None:
    """The step an id's name gives when its save recorded none: its trailing integer (`step_000300` -> 300)."""
    match = re.search(r"([0-9]+)$", name)
    return int(match.group(1)) if match else None


# What `aside_name` makes; names without the nonce or the host were made by earlier versions and are still
# recognised (as this host's: they were judged so before).
ASIDE_RE = re.compile(r"^\.old_(?P<name>.+)_(?P<pid>[0-9]+)(?:-(?P<nonce>[0-9a-f]{8})(?:-(?P<host>[0-9a-f]{8}))?)?$")


@functools.cache
def host_tag() -> str:
    """Eight hex digits naming this host, its boot and this process's pid namespace, put in every hidden name that
    carries a pid: a pid names a process only on the host (and boot) that gave it, and only in its pid namespace.
    On a filesystem that several hosts share (NFS), another host's name with a pid that is no process here was
    taken for a dead maker's, and its copy put back or removed under a replace still running there. Two
    containers of one host share its boot and may share its hostname (a pod with hostNetwork): without the
    namespace, gc in one put back a copy that the other's live replace had moved aside."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{boot}\0{pid_namespace()}".encode()).hexdigest()[:8]


def this_host() -> str:
    """This host as a claim on an object-store id names it: its hostname, then `#` and `host_tag` (boot and pid
    namespace). By the hostname alone, a claim made in another container of this host (the same hostname, another
    pid namespace) was judged by a pid of this one: no such process here, so a live save's claim was "dead" and
    another save took the id over."""
    return f"{socket.gethostname()}#{host_tag()}"


def same_host(held: str, mine: str) -> bool:
    """Whether a claim's `held` host is `mine` (`this_host`); a claim of an earlier version names the hostname
    alone, and is read as this host's where the hostname is this one's, as it was before."""
    return held == mine or held == mine.rpartition("#")[0]


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0 where that cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def made_here(match: re.Match[str]) -> bool:
    """Whether the hidden name `match` (of `ASIDE_RE` or `TRASH_RE`) was made on this host, so that its pid names
    a process here (a name of an earlier version, without a host, is taken as this host's, as it was before)."""
    return match["host"] is None or match["host"] == host_tag()


def new_nonce() -> str:
    """Eight hex digits that tell apart the hidden names of processes given the same pid (a job restarted in a
    container gets the pid of the one that was killed, and its names must not collide with the dead one's)."""
    return uuid.uuid4().hex[:8]


def aside_name(name: str, pid: int, nonce: str | None, host: str | None = None) -> str:
    """Where the non-exchange replace moves the old checkpoint `name` while the new one moves in (`host`: the
    maker's `host_tag`; None and no nonce only for the names earlier versions made)."""
    suffix = f"_{pid}" if nonce is None else f"_{pid}-{nonce}"
    return fit_name(".old_", name, suffix if host is None or nonce is None else f"{suffix}-{host}")


def aside_of(hidden: str, siblings: Iterable[str]) -> str | None:
    """The id the aside copy `hidden` was moved from: its name part, or for a cut name the sibling it was cut
    from; None when `hidden` is no aside name, or a cut one whose id is not among `siblings`."""
    match = ASIDE_RE.match(hidden)
    if match is None:
        return None
    if not may_be_cut(hidden):
        return match["name"]
    pid, nonce, host = int(match["pid"]), match["nonce"], match["host"]
    return cut_from(hidden, siblings, lambda sibling: aside_name(sibling, pid, nonce, host))


def trash_name(name: str, pid: int, nonce: str, host: str | None = None) -> str:
    """What retention and gc rename a directory to before removing it (never listed as a checkpoint); `host` as
    for `aside_name`."""
    return fit_name(".", name, f".trash-{pid}-{nonce}" if host is None else f".trash-{pid}-{nonce}-{host}")


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
        if match and aside_name(name, int(match["pid"]), match["nonce"], match["host"]) == entry:
            return (
                f" Its previous checkpoint is at {os.path.join(parent, entry)}: a save that replaced it was killed "
                f"before the new one moved in. Run `torch-checkpointing gc {parent}` to move it back, then load."
            )
    return ""


_held: set[str] = set()
_held_lock = threading.Lock()


class holding:
    """Marks a hidden name as in use by this process for the block, so that `held_here` tells it from one a
    killed process of the same pid left behind (pid liveness alone says "alive" for both)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.path.abspath(path)

    def __enter__(self) -> None:
        with _held_lock:
            _held.add(self._path)

    def __exit__(self, *exc: object) -> None:
        with _held_lock:
            _held.discard(self._path)


def held_here(path: str | os.PathLike[str]) -> bool:
    """Whether this process is using the hidden name `path` now (see `holding`)."""
    with _held_lock:
        return os.path.abspath(path) in _held
